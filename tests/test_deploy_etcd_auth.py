"""etcd's own access control from our client (issue 26): user/password authentication
(etcd's token fetched, sent with every call and watch, fetched again when it is stale)
and TLS with client certificates. A real etcd on 127.0.0.1 each time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from etcd_helpers import EtcdServer, etcd  # noqa: F401  (the fixture)
from ports import free_port
from mooncake_rs.deploy import EtcdClient, Membership, ModelFingerprint, WorkerRecord, WorkerRegistration
from mooncake_rs.errors import ServiceUnavailable

pytestmark = [pytest.mark.timeout(120)]

TOKEN = "cluster-token-0123456789abcdef"
FP = ModelFingerprint(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)


def _gateway(url: str, path: str, body: dict, token: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = token
    req = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read() or b"{}")


def _enable_auth(url: str, password: str) -> None:
    _gateway(url, "/v3/auth/role/add", {"name": "root"})
    _gateway(url, "/v3/auth/user/add", {"name": "root", "password": password})
    _gateway(url, "/v3/auth/user/grant", {"user": "root", "role": "root"})
    _gateway(url, "/v3/auth/enable", {})


def test_user_and_password_authentication(etcd: EtcdServer) -> None:  # noqa: F811
    _enable_auth(etcd.url, "root-pw")
    anonymous = EtcdClient(etcd.url)
    with pytest.raises(ServiceUnavailable):
        anonymous.put(b"/a", b"1")
    with pytest.raises(ServiceUnavailable):
        EtcdClient(etcd.url, user="root", password="wrong").put(b"/a", b"1")
    c = EtcdClient(etcd.url, user="root", password="root-pw")
    c.put(b"/a", b"1")
    assert c.get(b"/a").value == b"1"
    # a stale or revoked etcd token: fetched again, the call goes through
    c._auth_token = "stale.token.1"
    assert c.get(b"/a").value == b"1"
    # leases, the create transaction, watches and signed records, all authenticated
    seen: list[str] = []
    joined = threading.Event()

    def on_join(r: WorkerRecord) -> None:
        seen.append(r.name)
        joined.set()

    rec = WorkerRecord(name="p0", role="prefill", control="127.0.0.1:1", transfer="127.0.0.1:2", fingerprint=FP,
                       block_bytes=1024, capacity_blocks=8)
    with Membership(c, "/mooncake/auth", fingerprint=FP, on_join=on_join, check_s=0.2, token=TOKEN):
        with WorkerRegistration(c, "/mooncake/auth", rec, ttl_s=2, token=TOKEN):
            assert joined.wait(10)
    assert seen == ["p0"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, signed by it (the
    server one may authenticate clients too: etcd's JSON gateway dials etcd with it)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=test-ca", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


def test_tls_with_client_certificates(tmp_path: Path) -> None:
    binary = os.environ.get("MOONCAKE_ETCD") or shutil.which("etcd")
    if binary is None or shutil.which("openssl") is None:
        if os.environ.get("MOONCAKE_REQUIRE_ETCD") == "1" and binary is None:
            pytest.fail("etcd is required here (MOONCAKE_REQUIRE_ETCD=1) but not installed")
        pytest.skip("etcd or openssl not installed")
    _certificates(tmp_path)
    client_port, peer_port = free_port(), free_port()
    url, peer = f"https://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    log = open(tmp_path / "etcd.log", "ab")
    proc = subprocess.Popen(
        [binary, "--name", "t", "--data-dir", str(tmp_path / "data"), "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"t={peer}", "--cert-file", str(tmp_path / "server.pem"),
         "--key-file", str(tmp_path / "server.key"), "--client-cert-auth",
         "--trusted-ca-file", str(tmp_path / "ca.pem")], stdout=log, stderr=log)
    log.close()
    try:
        c = EtcdClient(url, ca_file=str(tmp_path / "ca.pem"), cert_file=str(tmp_path / "client.pem"),
                       key_file=str(tmp_path / "client.key"))
        deadline = time.monotonic() + 15
        while True:
            try:
                c.put(b"/tls", b"ok")
                break
            except ServiceUnavailable:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "etcd.log").read_text()
                time.sleep(0.1)
        assert c.get(b"/tls").value == b"ok"
        kvs, rev = c.get_prefix(b"/t")
        w = c.watch_prefix(b"/t", rev + 1)
        c.put(b"/tls2", b"x")
        assert next(iter(w))[0].key == b"/tls2"
        w.close()
        # without a client certificate, or trusting another CA: refused, typed
        with pytest.raises(ServiceUnavailable):
            EtcdClient(url, ca_file=str(tmp_path / "ca.pem")).get(b"/tls")
        with pytest.raises(ServiceUnavailable):
            EtcdClient(url, cert_file=str(tmp_path / "client.pem"), key_file=str(tmp_path / "client.key")).get(b"/tls")
    finally:
        proc.terminate()
        proc.wait(10)
