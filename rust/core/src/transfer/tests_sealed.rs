//! Sealed (token) TCP sessions over several connections per endpoint (issue 26, the
//! cost of security).

use super::config::{plain_connections, sealed_connections};
use super::tests::{bytes, cfg, fill, req, T};
use super::*;

// Issue 26, the cost of security: with a token, `connections_per_endpoint` 0 (the
// default) opens several connections on a host with cores to spare, so sealing and
// opening run on several threads per side. The frames are the ones a single connection
// sends; this checks the bytes a sealed transfer over four connections moves equal the
// ones an unsealed single connection moves, on many slices each way.
#[test]
fn sealed_transfers_over_several_connections_move_the_same_bytes_as_one_plain_one() {
    assert_eq!([0, 1, 2, 3, 4, 8, 16, 64].map(sealed_connections), [1, 1, 1, 1, 2, 4, 4, 4]);
    assert_eq!([0, 1, 2, 3, 64].map(plain_connections), [1, 1, 2, 2, 2]);
    let mut auto = cfg("auto", &["tcp"]);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    assert_eq!(auto.connections(), plain_connections(cores), "no token: two connections where there are two cores");
    auto.auth_token = Some("tok".into());
    assert_eq!(auto.connections(), sealed_connections(cores));
    auto.connections_per_endpoint = 3;
    assert_eq!(auto.connections(), 3, "an explicit count wins");

    let len = (5 << 20) + 4321; // several slices, the last one short, records cut mid-way
    let mut results = Vec::new();
    for (tok, conns) in [(None, 1), (Some("tok"), 4)] {
        let mut cs = cfg("srv", &["tcp"]);
        cs.auth_token = tok.map(Into::into);
        let b = Engine::new(cs, None).unwrap();
        let mut ca = cfg("cli", &["tcp"]);
        ca.auth_token = tok.map(Into::into);
        ca.connections_per_endpoint = conns;
        ca.slice_size = 256 << 10;
        let a = Engine::new(ca, None).unwrap();
        let p = a.connect("srv", Some(&b.address())).unwrap();
        assert_eq!(p.connections(), conns);
        let la = a.allocate(len, false).unwrap().id;
        let rb = b.allocate(len, false).unwrap().id;
        let (va, vb) = (fill(&a, la, 11), fill(&b, rb, 12));
        // Write the first half of `a` to `b`, read the second half of `b` into `a`, in
        // requests of uneven sizes so slices of both kinds interleave on every connection.
        let half = len / 2;
        let mut reqs = Vec::new();
        let mut at = 0;
        for (i, size) in [300_000usize, 1 << 20, 77_777, 900_000].iter().cycle().enumerate() {
            if at >= len {
                break;
            }
            let n = (*size).min(if at < half { half - at } else { len - at });
            let op = if at < half { Op::Write } else { Op::Read };
            reqs.push(req(op, la, at as u64, &p, rb, at as u64, n as u64));
            at += n;
            assert!(i < 1000);
        }
        let st = a.submit(reqs, T).unwrap().wait(None);
        assert!(st.iter().all(|s| s.is_ok()), "{st:?}");
        let (ga, gb) = (bytes(&a, la), bytes(&b, rb));
        assert!(gb[..half] == va[..half], "written half differs (token: {tok:?})");
        let first_bad = (half..len).find(|&i| ga[i] != vb[i]);
        assert!(first_bad.is_none(), "read half differs at byte {first_bad:?} of {len} (token: {tok:?})");
        results.push((ga, gb));
    }
    assert!(results[0] == results[1], "the sealed multi-connection transfer differs from the plain one");
}
