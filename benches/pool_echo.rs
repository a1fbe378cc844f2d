//! The native floor of one synchronous 128 B request/response over a TCP link, for
//! benches/pool_bench.py's remote small-key rows (std only: pool_bench.py builds it with
//! `rustc -O` into a temporary directory, no cargo).
//!
//!     pool_echo server HOST [poll]          prints {"address": "HOST:PORT"}, echoes one connection
//!     pool_echo client HOST:PORT N [poll]   5 passes of N round trips (after 50 warm-up ones),
//!                                           prints {"ops": the median pass's calls a second}
//!
//! Each call is what the smallest pool request needs at least: the client writes 128 bytes,
//! the server reads them whole and writes them back, the client reads them whole. TCP_NODELAY,
//! one thread a side: no framing, decoding or hand-off between threads. Reads sleep in the
//! kernel until bytes come, or with `poll` (both ends) they poll a non-blocking socket and
//! yield the CPU between tries, as the pool's own reads do before they sleep
//! (rust/core/src/spin_read.rs), so the echo stays the floor of a design that polls: a
//! sleeping read on this project's KVM host pays a hypervisor wake-up a round trip.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::Instant;

const MSG: usize = 128;
const WARMUP: usize = 50;
const REPS: usize = 5;

/// `buf` whole from `conn`: in the kernel's blocking read, or (`poll`) by trying a
/// non-blocking read and yielding the CPU until the bytes are there.
fn read_whole(conn: &mut TcpStream, buf: &mut [u8], poll: bool) -> std::io::Result<()> {
    if !poll {
        return conn.read_exact(buf);
    }
    let mut got = 0;
    while got < buf.len() {
        match conn.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `buf` whole to `conn` (a non-blocking socket's full send buffer is waited out by yielding).
fn write_whole(conn: &mut TcpStream, buf: &[u8]) -> std::io::Result<()> {
    let mut sent = 0;
    while sent < buf.len() {
        match conn.write(&buf[sent..]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn serve(host: &str, poll: bool) -> std::io::Result<()> {
    let listener = TcpListener::bind((host, 0))?;
    println!("{{\"address\": \"{}\"}}", listener.local_addr()?);
    std::io::stdout().flush()?;
    let (mut conn, _) = listener.accept()?;
    conn.set_nodelay(true)?;
    conn.set_nonblocking(poll)?;
    let mut buf = [0u8; MSG];
    loop {
        match read_whole(&mut conn, &mut buf, poll) {
            Ok(()) => write_whole(&mut conn, &buf)?,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

fn client(address: &str, calls: usize, poll: bool) -> std::io::Result<f64> {
    let mut conn = TcpStream::connect(address)?;
    conn.set_nodelay(true)?;
    conn.set_nonblocking(poll)?;
    let mut msg = [0u8; MSG];
    for (i, b) in msg.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let mut back = [0u8; MSG];
    let mut once = |conn: &mut TcpStream| -> std::io::Result<()> {
        write_whole(conn, &msg)?;
        read_whole(conn, &mut back, poll)?;
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
    let mut args: Vec<String> = std::env::args().collect();
    let poll = args.last().is_some_and(|a| a == "poll");
    if poll {
        args.pop();
    }
    let result = match args.get(1).map(String::as_str) {
        Some("server") if args.len() == 3 => serve(&args[2], poll).map(|()| None),
        Some("client") if args.len() == 4 => match args[3].parse::<usize>() {
            Ok(n) if n > 0 => client(&args[2], n, poll).map(Some),
            _ => Err(std::io::Error::other(format!("N must be a count > 0, got {:?}", args[3]))),
        },
        _ => Err(std::io::Error::other("usage: pool_echo server HOST [poll] | pool_echo client HOST:PORT N [poll]")),
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
