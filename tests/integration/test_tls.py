"""TLS and mutual TLS on every server: a client that does not trust the server's CA, or (mTLS)
presents no certificate, is refused; with them, calls, a whole job (coordinator to workers, engine
pulling weights from the trainer) and the REST API work. Certificates are made here."""

from __future__ import annotations

import datetime
import ipaddress
import textwrap
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import rpc
from services.api import coordinator_pb2, trainer_pb2, trainer_pb2_grpc
from services.tls import TlsConfig
from tests.integration.conftest import run_job

pytestmark = pytest.mark.faults


def _issue(subject: str, *, ca=None, server: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1)))
    if ca is None:  # self-signed CA
        builder = builder.issuer_name(name).add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        signer = key
    else:
        ca_cert, signer = ca
        builder = builder.issuer_name(ca_cert.subject).add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server else \
            [ExtendedKeyUsageOID.CLIENT_AUTH]  # a server's certificate also serves it as a client
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), False)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("rlfleet"), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                False)
    cert = builder.sign(signer, hashes.SHA256())
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert, key, cert.public_bytes(serialization.Encoding.PEM), pem_key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("pki")
    ca_cert, ca_key, ca_pem, _ = _issue("rlfleet test CA")
    _, _, server_pem, server_key = _issue("rlfleet", ca=(ca_cert, ca_key), server=True)
    _, _, client_pem, client_key = _issue("rlfleet client", ca=(ca_cert, ca_key))
    _, _, stranger_ca_pem, _ = _issue("someone else's CA")
    files = {"ca": ca_pem, "server.crt": server_pem, "server.key": server_key, "client.crt": client_pem,
             "client.key": client_key, "stranger-ca": stranger_ca_pem}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return {name: directory / name for name in files}


def _tls_env(monkeypatch, pki, *, client_auth: bool) -> None:
    monkeypatch.setenv("RLFLEET_TLS_CERT", str(pki["server.crt"]))
    monkeypatch.setenv("RLFLEET_TLS_KEY", str(pki["server.key"]))
    monkeypatch.setenv("RLFLEET_TLS_CA", str(pki["ca"]))
    monkeypatch.setenv("RLFLEET_TLS_CLIENT_AUTH", "1" if client_auth else "0")


def _status(address: str, tls: TlsConfig | None) -> grpc.StatusCode:
    channel = rpc.open_channel(address, tls=tls) if tls is not None else grpc.insecure_channel(address)
    try:
        trainer_pb2_grpc.TrainerStub(channel).GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()
    finally:
        channel.close()


def test_tls_server_answers_clients_that_trust_its_ca_only(monkeypatch, pki):
    from services.trainer.server import build_server

    _tls_env(monkeypatch, pki, client_auth=False)
    server = build_server("127.0.0.1:0")
    address = f"127.0.0.1:{server.port}"
    try:
        assert _status(address, TlsConfig.from_files(ca=str(pki["ca"]))) == grpc.StatusCode.OK
        assert _status(address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
        assert _status(address, TlsConfig.from_files(ca=str(pki["stranger-ca"]))) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_mutual_tls_refuses_clients_without_a_certificate_and_may_listen_beyond_loopback(monkeypatch, pki):
    from services.trainer.server import build_server

    _tls_env(monkeypatch, pki, client_auth=True)
    server = build_server("0.0.0.0:0")  # no token: mutual TLS authenticates
    address = f"127.0.0.1:{server.port}"
    try:
        assert _status(address, TlsConfig.from_files(ca=str(pki["ca"]))) == grpc.StatusCode.UNAVAILABLE
        client = TlsConfig.from_files(cert=str(pki["client.crt"]), key=str(pki["client.key"]), ca=str(pki["ca"]))
        assert _status(address, client) == grpc.StatusCode.OK
        with rpc.open_channel(address, tls=client) as ch:  # health too, the way probes ask
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    finally:
        server.stop(0)
    monkeypatch.setenv("RLFLEET_TLS_CLIENT_AUTH", "0")
    with pytest.raises(ValueError, match="without a token or mutual TLS"):
        build_server("0.0.0.0:0")


def test_a_whole_job_runs_over_mutual_tls(tmp_path, pki, tiny_model_dir, task_files):
    from services.launcher import LocalFleet
    from tests.conftest import stop_fleet

    train, test = task_files
    env = {"OMP_NUM_THREADS": "1", "RLFLEET_TLS_CERT": str(pki["server.crt"]), "RLFLEET_TLS_KEY": str(pki["server.key"]),
           "RLFLEET_TLS_CA": str(pki["ca"]), "RLFLEET_TLS_CLIENT_AUTH": "1", "RLFLEET_TLS_SERVER_NAME": "rlfleet"}
    local = LocalFleet(tmp_path / "logs", env=env)
    try:
        trainer = local.start("trainer", "trainer-0", ["--checkpoint-root", str(tmp_path)])
        rollout = local.start("rollout", "rollout-0", [])
        local.wait_ready()
        coordinator = local.start("coordinator", "coordinator", [
            "--trainers", trainer.address, "--rollouts", rollout.address, "--db", "memory", "--http-port", "0"])
        local.wait_ready()
        job = textwrap.dedent(f"""
            name: over-tls
            model: {tiny_model_dir}
            num_rollout: 2
            output_dir: {tmp_path / 'out'}
            rollout: {{prompts_per_step: 2, samples_per_prompt: 2, sampling: {{max_new_tokens: 3}}}}
            data: {{train: {train}}}
            eval: {{every: 0, datasets: [{{name: h, path: {test}, limit: 4, sampling: {{max_new_tokens: 3}}}}]}}
            weight_sync: {{plane: grpc_stream}}
            """)
        client = TlsConfig.from_files(cert=str(pki["client.crt"]), key=str(pki["client.key"]), ca=str(pki["ca"]),
                                      server_name="rlfleet")
        final, events = run_job(coordinator.address, job, tls=client)
        assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
        assert any(e.kind == "weight_sync" for e in events)
        # the REST API over HTTPS, client certificate required
        import json

        import httpx

        import ssl

        http_port = json.loads(coordinator.ready_file.read_text())["http_port"]
        url = f"https://127.0.0.1:{http_port}/v1/jobs"
        trusting = ssl.create_default_context(cafile=str(pki["ca"]))
        with pytest.raises(httpx.HTTPError):  # no client certificate
            httpx.get(url, verify=trusting)
        trusting.load_cert_chain(str(pki["client.crt"]), str(pki["client.key"]))
        with httpx.Client(verify=trusting) as https:
            assert https.get(url).status_code == 200
    finally:
        stop_fleet(local, log_lines=10)
