"""CURVE keys and the ZAP decision (broker/auth.py): key files, every reason, the ZAP frames, and real sockets.

The end-to-end tests bind CURVE servers on tcp://127.0.0.1 with a ZAP handler thread made of auth.py's functions,
as the broker's loop will be: an allowed key exchanges a message; a wrong key, a key of the other role, no key
and a wrong broker key do not, and each refusal is seen (by ZAP or by the socket monitor) with its reason.
"""

from __future__ import annotations

import os
import queue
import stat
import sys
import threading
from pathlib import Path

import pytest
import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from sparkbus.broker import auth
from sparkbus.broker.auth import KeyAuthority, create_keypair, make_curve_client, make_curve_server, zap_reply
from sparkbus.wire.errors import AuthError, SparkbusError

from harness import key_directory, run_child

WAIT_MS = 5000


@pytest.fixture
def keydir(tmp_path):
    """``DIR`` with a broker pair, feeders/spark.key and ranks/trainer.key; the clients' pairs in tmp_path/clients."""
    directory, clients = tmp_path / "auth", tmp_path / "clients"
    key_directory(directory, clients, {"spark": "feeders", "trainer": "ranks", "stranger": None})
    return directory, clients


def raw_key(path):
    return z85.decode(auth.load_public_key(path))


# ---- key files ----------------------------------------------------------------------------------------------

def test_create_keypair_writes_pyzmq_certificates_with_a_private_secret(tmp_path):
    public_file, secret_file = create_keypair(tmp_path / "node")
    assert (public_file.name, secret_file.name) == ("node.key", "node.key_secret")
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(public_file.stat().st_mode) == 0o644
    public, secret = zmq.auth.load_certificate(secret_file)
    assert zmq.auth.load_certificate(public_file) == (public, None)
    assert zmq.curve_public(secret) == public
    assert secret not in public_file.read_bytes()
    assert auth.load_key_pair(secret_file) == (public, secret)


def test_create_keypair_never_overwrites_and_says_why(tmp_path):
    create_keypair(tmp_path / "node")
    with pytest.raises(AuthError, match="exists already"):
        create_keypair(tmp_path / "node")
    with pytest.raises(AuthError, match="no such directory"):
        create_keypair(tmp_path / "missing" / "node")


def test_key_files_of_the_wrong_kind_or_missing_are_refused_with_a_sparkbus_error(tmp_path):
    public_file, secret_file = create_keypair(tmp_path / "node")
    with pytest.raises(AuthError, match="secret key file"):
        auth.load_public_key(secret_file)                 # the broker's secret must not go to clients
    with pytest.raises(AuthError, match="only a public key"):
        auth.load_key_pair(public_file)
    with pytest.raises(AuthError, match="does not exist"):
        auth.load_public_key(tmp_path / "nothing.key")
    (tmp_path / "junk.key").write_text("hello\n")
    with pytest.raises(AuthError, match="not a key file"):
        auth.load_public_key(tmp_path / "junk.key")
    (tmp_path / "short.key").write_text('curve\n    public-key = "abcde"\n')
    with pytest.raises(AuthError, match="malformed public key"):
        auth.load_public_key(tmp_path / "short.key")
    assert issubclass(AuthError, SparkbusError)


def test_a_secret_key_readable_by_others_is_used_with_a_warning(tmp_path, caplog):
    _, secret_file = create_keypair(tmp_path / "node")
    os.chmod(secret_file, 0o644)
    auth.load_key_pair(secret_file)
    assert "chmod 600" in caplog.text


# ---- decisions ----------------------------------------------------------------------------------------------

def test_decide_admits_each_role_on_its_own_domains_only(keydir):
    directory, clients = keydir
    authority = KeyAuthority(directory)
    spark, trainer, stranger = (raw_key(clients / f"{n}.key") for n in ("spark", "trainer", "stranger"))
    assert authority.counts() == {"feeder": 1, "rank": 1}
    expected = {("feed", spark): (True, "allowed"), ("control", spark): (True, "allowed"),
                ("ranks", spark): (False, "wrong_role"),
                ("feed", trainer): (False, "wrong_role"), ("control", trainer): (False, "wrong_role"),
                ("ranks", trainer): (True, "allowed")}
    for (domain, key), decision in expected.items():
        assert authority.decide(domain, "10.0.0.1", "CURVE", key) == decision, (domain, key)
    for domain in ("feed", "control", "ranks"):
        assert authority.decide(domain, "10.0.0.1", "CURVE", stranger) == (False, "unknown_key")
        assert authority.decide(domain, "10.0.0.1", "NULL", spark) == (False, "not_curve")
        assert authority.decide(domain, "10.0.0.1", "PLAIN", trainer) == (False, "not_curve")
        assert authority.decide(domain, "10.0.0.1", "CURVE", None) == (False, "no_key")
        assert authority.decide(domain, "10.0.0.1", "CURVE", b"short") == (False, "no_key")
    assert authority.decide("admin", "10.0.0.1", "CURVE", spark) == (False, "unknown_domain")
    assert authority.decide("feed", "10.0.0.1", "CURVE", z85.encode(spark)) == (True, "allowed")
    assert authority.name_of(spark) == "feeder:spark" and authority.name_of(stranger) is None


def test_a_key_in_both_folders_may_feed_and_consume(keydir):
    directory, clients = keydir
    (directory / "ranks" / "spark.key").write_bytes((clients / "spark.key").read_bytes())
    authority = KeyAuthority(directory)
    spark = raw_key(clients / "spark.key")
    assert all(authority.decide(d, "", "CURVE", spark) == (True, "allowed") for d in ("feed", "control", "ranks"))


def test_reload_picks_up_added_and_removed_keys_and_keeps_the_old_lists_on_a_bad_file(keydir):
    directory, clients = keydir
    authority = KeyAuthority(directory)
    stranger = raw_key(clients / "stranger.key")
    (directory / "feeders" / "stranger.key").write_bytes((clients / "stranger.key").read_bytes())
    (directory / "ranks" / "trainer.key").unlink()
    assert authority.reload() == {"feeder": 2, "rank": 0}
    assert authority.decide("feed", "", "CURVE", stranger) == (True, "allowed")
    (directory / "feeders" / "broken.key").write_text("not a key\n")
    with pytest.raises(AuthError, match="broken.key"):
        authority.reload()
    assert authority.counts() == {"feeder": 2, "rank": 0}
    assert authority.decide("feed", "", "CURVE", stranger) == (True, "allowed")


def test_the_authority_needs_its_directory_and_the_broker_pair(tmp_path, keydir):
    with pytest.raises(AuthError, match="does not exist"):
        KeyAuthority(tmp_path / "nowhere")
    directory, _ = keydir
    (directory / "broker.key_secret").unlink()
    with pytest.raises(AuthError, match="broker.key_secret"):
        KeyAuthority(directory)


def test_the_authority_never_shows_its_secret(keydir):
    directory, _ = keydir
    authority = KeyAuthority(directory)
    assert authority.secret_key.decode() not in repr(authority)
    assert authority.secret_key.decode() not in str(vars(authority).get("directory"))


# ---- ZAP frames ---------------------------------------------------------------------------------------------

def zap_request(domain, mechanism, key, request_id=b"7", version=b"1.0"):
    return [version, request_id, domain.encode(), b"192.0.2.5", b"", mechanism.encode(),
            *([key] if key is not None else [])]


def test_zap_reply_follows_rfc_27(keydir):
    directory, clients = keydir
    authority = KeyAuthority(directory)
    spark = raw_key(clients / "spark.key")
    reply, allowed, reason, address = zap_reply(zap_request("feed", "CURVE", spark), authority)
    assert reply == [b"1.0", b"7", b"200", b"OK", b"feeder:spark", b""]
    assert (allowed, reason, address) == (True, "allowed", "192.0.2.5")
    reply, allowed, reason, address = zap_reply(zap_request("ranks", "CURVE", spark, b"8"), authority)
    assert reply == [b"1.0", b"8", b"400", b"wrong_role", b"", b""] and not allowed and reason == "wrong_role"
    assert zap_reply(zap_request("feed", "NULL", None), authority)[0][2:4] == [b"400", b"not_curve"]
    assert zap_reply([zmq.Frame(f) for f in zap_request("control", "CURVE", spark)], authority)[1]


@pytest.mark.parametrize("request_frames", [[b"2.0", b"9", b"feed", b"", b"", b"CURVE", b"k" * 32],
                                            [b"1.0", b"9", b"feed"], [], [b"1.0"]])
def test_a_request_that_is_not_zap_1_0_is_refused_and_still_answered(keydir, request_frames):
    reply, allowed, reason, _ = zap_reply(request_frames, KeyAuthority(keydir[0]))
    assert len(reply) == 6 and reply[0] == b"1.0" and reply[2] == b"400"
    assert (allowed, reason) == (False, "bad_request")


def test_handshake_refusals_seen_only_by_the_monitor_have_reasons():
    event = {"event": zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL}
    assert auth.handshake_refusal({**event, "value": zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH}) == "no_key"
    assert auth.handshake_refusal({**event, "value": zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC}) == "wrong_broker_key"
    assert auth.handshake_refusal({**event, "value": zmq.PROTOCOL_ERROR_ZMTP_UNSPECIFIED}) == "bad_handshake"
    assert auth.handshake_refusal({"event": zmq.EVENT_HANDSHAKE_FAILED_AUTH, "value": 400}) is None
    assert auth.handshake_refusal({"event": zmq.EVENT_CONNECTED, "value": 0}) is None


# ---- client options -----------------------------------------------------------------------------------------

def test_make_curve_client_takes_paths_or_the_environment(keydir, monkeypatch, context):
    directory, clients = keydir
    sock = context.socket(zmq.DEALER)
    try:
        monkeypatch.delenv(auth.KEY_ENV, raising=False)
        monkeypatch.delenv(auth.BROKER_KEY_ENV, raising=False)
        assert make_curve_client(sock) is False
        monkeypatch.setenv(auth.KEY_ENV, str(clients / "spark.key_secret"))
        with pytest.raises(AuthError, match=auth.BROKER_KEY_ENV):
            make_curve_client(sock)
        monkeypatch.setenv(auth.BROKER_KEY_ENV, str(directory / "broker.key"))
        assert make_curve_client(sock) is True
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE and sock.getsockopt(zmq.CURVE_SERVER) == 0
        with pytest.raises(AuthError, match="secret key file"):
            make_curve_client(sock, broker_key=directory / "broker.key_secret")
        with pytest.raises(AuthError, match="only a public key"):
            make_curve_client(sock, key=clients / "spark.key")
    finally:
        sock.close(linger=0)


def test_server_options_fail_closed_and_refuse_unknown_domains(keydir):
    authority = KeyAuthority(keydir[0])
    options = dict(auth.server_socket_options(authority, "ranks"))
    assert options[zmq.CURVE_SERVER] == 1 and options[zmq.ZAP_DOMAIN] == b"ranks"
    assert options[zmq.ZAP_ENFORCE_DOMAIN] == 1
    with pytest.raises(AuthError, match="unknown ZAP domain"):
        auth.server_socket_options(authority, "admin")


# ---- real sockets -------------------------------------------------------------------------------------------

class ZapHandler:
    """A ZAP handler thread made of auth.zap_reply, as the broker loop will run one: decisions go to a queue."""

    def __init__(self, context, authority):
        self.decisions: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(context, authority), daemon=True)
        self._thread.start()
        assert self._bound.wait(5), "ZAP handler did not bind"

    def _run(self, context, authority):
        sock = context.socket(zmq.REP)
        sock.linger = 0
        try:
            sock.bind(auth.ZAP_ENDPOINT)
            self._bound.set()
            while not self._stop.is_set():
                if sock.poll(50):
                    reply, allowed, reason, address = zap_reply(sock.recv_multipart(), authority)
                    sock.send_multipart(reply)
                    self.decisions.put((allowed, reason, address))
        finally:
            sock.close(linger=0)

    def next(self):
        return self.decisions.get(timeout=WAIT_MS / 1000)

    def stop(self):
        self._stop.set()
        self._thread.join(5)
        assert not self._thread.is_alive()


@pytest.fixture
def curve_broker(context, keydir):
    """A ROUTER (domain ``ranks``) and a PULL (domain ``feed``) CURVE server on loopback, a ZAP handler, a monitor."""
    directory, clients = keydir
    authority = KeyAuthority(directory)
    zap = ZapHandler(context, authority)
    servers = {}
    for domain, kind in (("ranks", zmq.ROUTER), ("feed", zmq.PULL)):
        sock = context.socket(kind)
        sock.linger = 0
        make_curve_server(sock, authority, domain)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        servers[domain] = (sock, f"tcp://127.0.0.1:{port}", sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL))
    made = []

    def client(domain, key=None, broker_key=None, plain=False):
        sock = context.socket(zmq.DEALER if domain == "ranks" else zmq.PUSH)
        sock.linger = 0
        made.append(sock)
        if not plain:
            assert make_curve_client(sock, key, broker_key or directory / "broker.key")
        sock.connect(servers[domain][1])
        sock.send(b"hello", zmq.NOBLOCK if domain == "ranks" else 0)
        return sock

    yield servers, zap, client, clients
    for sock in made:
        sock.close(linger=0)
    for sock, _, monitor in servers.values():
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
    zap.stop()


def received(sock, wait_ms=WAIT_MS):
    return sock.recv_multipart()[-1] if sock.poll(wait_ms) else None


@pytest.mark.parametrize("domain, name", [("ranks", "trainer"), ("feed", "spark")])
def test_an_allowed_key_exchanges_messages(curve_broker, domain, name):
    servers, zap, client, clients = curve_broker
    client(domain, key=clients / f"{name}.key_secret")
    assert zap.next() == (True, "allowed", "127.0.0.1")
    assert received(servers[domain][0]) == b"hello"


@pytest.mark.parametrize("domain, name, reason", [("ranks", "stranger", "unknown_key"),
                                                  ("ranks", "spark", "wrong_role"),
                                                  ("feed", "trainer", "wrong_role"),
                                                  ("feed", "stranger", "unknown_key")])
def test_a_refused_key_cannot_send_and_the_refusal_names_its_reason_and_address(curve_broker, domain, name, reason):
    servers, zap, client, clients = curve_broker
    client(domain, key=clients / f"{name}.key_secret")
    assert zap.next() == (False, reason, "127.0.0.1")
    # the refusal has happened: the handshake is over and nothing can have got through
    assert received(servers[domain][0], wait_ms=200) is None


def test_an_allowed_key_still_gets_through_beside_a_refused_one(curve_broker):
    servers, zap, client, clients = curve_broker
    client("ranks", key=clients / "stranger.key_secret")
    assert zap.next()[:2] == (False, "unknown_key")
    client("ranks", key=clients / "trainer.key_secret")
    assert received(servers["ranks"][0]) == b"hello"


@pytest.mark.parametrize("domain", ["ranks", "feed"])
def test_a_peer_without_keys_or_with_another_broker_key_fails_the_handshake(curve_broker, tmp_path, domain):
    servers, zap, client, clients = curve_broker
    sock, _, monitor = servers[domain]
    client(domain, plain=True)
    assert monitor.poll(WAIT_MS)
    assert auth.handshake_refusal(recv_monitor_message(monitor)) == "no_key"
    assert received(sock, wait_ms=200) is None

    other_public, _ = create_keypair(tmp_path / "impostor")
    client(domain, key=clients / "trainer.key_secret", broker_key=other_public)
    assert monitor.poll(WAIT_MS)
    assert auth.handshake_refusal(recv_monitor_message(monitor)) == "wrong_broker_key"
    assert received(sock, wait_ms=200) is None
    assert zap.decisions.empty()          # neither reached ZAP: libzmq refused them first


# ---- sparkbus keys create -----------------------------------------------------------------------------------

def sparkbus(*args, timeout=30):
    command = [str(Path(sys.executable).with_name("sparkbus")), *args]
    result = run_child(command, timeout=timeout)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_keys_create_writes_the_pair_and_says_where_each_file_goes_without_the_secret(tmp_path):
    result = sparkbus("keys", "create", str(tmp_path / "spark-prod"))
    assert result.returncode == 0, result.stderr
    public_file, secret_file = tmp_path / "spark-prod.key", tmp_path / "spark-prod.key_secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    public, secret = zmq.auth.load_certificate(secret_file)
    assert secret.decode() not in result.stdout + result.stderr
    for where in ("DIR/broker.key_secret", "DIR/feeders/", "DIR/ranks/", "SPARKBUS_BROKER_KEY",
                  "spark.executorEnv.SPARKBUS_KEY", "-genv SPARKBUS_KEY", str(public_file), str(secret_file)):
        assert where in result.stdout, where


def test_keys_create_refuses_to_overwrite_as_a_usage_error(tmp_path):
    create_keypair(tmp_path / "node")
    before = (tmp_path / "node.key_secret").read_bytes()
    result = sparkbus("keys", "create", str(tmp_path / "node"))
    assert result.returncode == 2 and "exists already" in result.stderr
    assert (tmp_path / "node.key_secret").read_bytes() == before
    assert sparkbus("keys").returncode == 2                      # a subcommand is required
