"""TLS and mutual TLS for every rlfleet server and client.

A process is given PEM files once: its own certificate and key (what it presents), and the CA that
signed its peers' certificates (what it trusts). `rlfleet serve --tls-cert/--tls-key/--tls-ca`
puts them in the environment (`RLFLEET_TLS_CERT`, `_KEY`, `_CA`), so every server the process
runs and every channel it opens (coordinator to workers, engine to trainer) use them.
`--tls-client-auth` makes servers require a client certificate signed by the CA (mTLS): then a
server may listen beyond loopback without a bearer token. Pods are reached by address, which no
certificate names, so clients check the name `RLFLEET_TLS_SERVER_NAME` (default: the address's
host) in the server's certificate instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

ENV = {"cert": "RLFLEET_TLS_CERT", "key": "RLFLEET_TLS_KEY", "ca": "RLFLEET_TLS_CA",
       "client_auth": "RLFLEET_TLS_CLIENT_AUTH", "server_name": "RLFLEET_TLS_SERVER_NAME"}


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    cert: bytes | None = None  # PEM chain this process presents
    key: bytes | None = None
    ca: bytes | None = None  # PEM bundle of the CA(s) its peers' certificates chain to
    client_auth: bool = False  # servers require a client certificate signed by `ca`
    server_name: str = ""  # the name clients expect in a server's certificate
    files: dict[str, str] = field(default_factory=dict)  # where cert, key and ca were read (HTTPS needs paths)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("tls: a certificate needs its key and a key its certificate (--tls-cert, --tls-key)")
        if self.client_auth and self.ca is None:
            raise ValueError("tls: --tls-client-auth needs --tls-ca to check client certificates against")

    @property
    def serves(self) -> bool:
        return self.cert is not None

    @property
    def mutual(self) -> bool:
        return self.serves and self.client_auth

    @classmethod
    def from_files(cls, *, cert: str | None = None, key: str | None = None, ca: str | None = None,
                   client_auth: bool = False, server_name: str = "") -> "TlsConfig":
        def read(name: str, path: str | None) -> bytes | None:
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"{name}: cannot read {path} ({e.strerror or e})") from e

        return cls(cert=read("tls-cert", cert), key=read("tls-key", key), ca=read("tls-ca", ca),
                   client_auth=client_auth, server_name=server_name,
                   files={name: path for name, path in (("cert", cert), ("key", key), ("ca", ca)) if path})

    @classmethod
    def from_env(cls) -> "TlsConfig | None":
        """The process's TLS settings, or None when it has none (plaintext, loopback)."""
        values = {name: os.environ.get(var, "") for name, var in ENV.items()}
        if not (values["cert"] or values["ca"]):
            return None
        return cls.from_files(cert=values["cert"] or None, key=values["key"] or None, ca=values["ca"] or None,
                              client_auth=values["client_auth"] in ("1", "true", "yes"),
                              server_name=values["server_name"])

    def export(self, cert: str | None, key: str | None, ca: str | None) -> None:
        """Make these files the process's TLS settings (for the channels it opens)."""
        for name, value in (("cert", cert), ("key", key), ("ca", ca)):
            if value:
                os.environ[ENV[name]] = str(Path(value).absolute())
        os.environ[ENV["client_auth"]] = "1" if self.client_auth else "0"
        if self.server_name:
            os.environ[ENV["server_name"]] = self.server_name

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def uvicorn_settings(self) -> dict:
        """uvicorn's HTTPS settings for the same files and client-certificate rule."""
        import ssl

        return {"ssl_certfile": self.files["cert"], "ssl_keyfile": self.files["key"], "ssl_ca_certs": self.files.get("ca"),
                "ssl_cert_reqs": ssl.CERT_REQUIRED if self.client_auth else ssl.CERT_NONE}
