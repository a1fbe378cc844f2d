//! The native floor of one synchronous 128 B request/response over a TCP link, for
//! benches/pool_bench.py's remote small-key rows (std only: pool_bench.py builds it with
//! `rustc -O` into a temporary directory, no cargo).
//!
//!     pool_echo server HOST          prints {"address": "HOST:PORT"}, echoes one connection
//!     pool_echo client HOST:PORT N   5 passes of N round trips (after 50 warm-up ones),
//!                                    prints {"ops": the median pass's calls a second}
//!
//! Each call is what the smallest pool request needs at least: the client writes 128 bytes,
//! the server reads them whole and writes them back, the client reads them whole. Blocking
//! sockets, TCP_NODELAY, one thread a side: no framing, decoding or hand-off between threads.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::Instant;

const MSG: usize = 128;
const WARMUP: usize = 50;
const REPS: usize = 5;

fn serve(host: &str) -> std::io::Result<()> {
    let listener = TcpListener::bind((host, 0))?;
    println!("{{\"address\": \"{}\"}}", listener.local_addr()?);
    std::io::stdout().flush()?;
    let (mut conn, _) = listener.accept()?;
    conn.set_nodelay(true)?;
    let mut buf = [0u8; MSG];
    loop {
        match conn.read_exact(&mut buf) {
            Ok(()) => conn.write_all(&buf)?,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

fn client(address: &str, calls: usize) -> std::io::Result<f64> {
    let mut conn = TcpStream::connect(address)?;
    conn.set_nodelay(true)?;
    let mut msg = [0u8; MSG];
    for (i, b) in msg.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let mut back = [0u8; MSG];
    let mut once = |conn: &mut TcpStream| -> std::io::Result<()> {
        conn.write_all(&msg)?;
        conn.read_exact(&mut back)?;
        if back != msg {
            return Err(std::io::Error::other("the echo returned other bytes"));
        }
        Ok(())
    };
    for _ in 0..WARMUP {
        once(&mut conn)?;
    }
    // the median of REPS passes: one pass of a few ms on shared cores can lose a whole
    // scheduling slice
    let mut rates = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let start = Instant::now();
        for _ in 0..calls {
            once(&mut conn)?;
        }
        rates.push(calls as f64 / start.elapsed().as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[REPS / 2])
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let result = match args.get(1).map(String::as_str) {
        Some("server") if args.len() == 3 => serve(&args[2]).map(|()| None),
        Some("client") if args.len() == 4 => match args[3].parse::<usize>() {
            Ok(n) if n > 0 => client(&args[2], n).map(Some),
            _ => Err(std::io::Error::other(format!("N must be a count > 0, got {:?}", args[3]))),
        },
        _ => Err(std::io::Error::other("usage: pool_echo server HOST | pool_echo client HOST:PORT N")),
    };
    match result {
        Ok(Some(ops)) => {
            println!("{{\"ops\": {ops}}}");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pool_echo: {e}");
            ExitCode::FAILURE
        }
    }
}
