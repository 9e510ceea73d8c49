"""The device-facing front door: nginx, passing only the Fleet API and ``/health``.

Flower 1.42 serves its Control API (``/v1/control/*``: start runs, register
node keys), the ServerApp's Runtime API (``/v1/runtime/*``) and the Fleet API
(``/v1/fleet/*``) on one HTTP port, and the open-source build checks no
credentials on the first two: anyone who reaches the port can register a key
of their own. So the SuperLink listens on loopback only and nginx, a
maintained TLS-terminating reverse proxy, faces the devices and forwards
nothing but ``POST /v1/fleet/<rpc>`` and ``GET /health``; every other path is
answered 403 by nginx without touching the SuperLink. Each device address
may make ``rate_limit`` Fleet requests a second (bursts of twice that pass
at once); beyond that nginx answers 503, which Flower's SuperNode retries
with back-off (it gives up on a 429), so one misbehaving or hostile host
cannot flood the SuperLink.

Fleet in 1.42 is protobuf over plain HTTP POSTs (not gRPC): node
authentication travels in signed headers (``flwr-public-key``,
``flwr-signature``, ``flwr-timestamp``) that nginx passes through untouched,
so the SuperLink still verifies every device itself.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from deploy.errors import ProcessFailed

__all__ = ["ProxySpec", "FLEET_RPCS", "render_nginx_conf", "nginx_binary", "nginx_command"]

# The Fleet RPCs a SuperNode calls (flwr/supercore/protobuf/translation.py in 1.42).
# An explicit list, not a prefix, so a route added to /v1/fleet/ by a later Flower
# release is refused until someone looks at it.
FLEET_RPCS = ("register-node", "activate-node", "deactivate-node", "unregister-node",
              "send-node-heartbeat", "pull-messages", "push-messages", "get-run", "get-fab",
              "push-object", "pull-object", "confirm-message-received")


@dataclass(frozen=True)
class ProxySpec:
    """Where nginx listens, where the SuperLink is, and the files it needs."""

    listen_host: str
    listen_port: int
    upstream_port: int          # the SuperLink on 127.0.0.1
    server_cert: Path | None    # full chain; None: plain HTTP (insecure trial on loopback)
    server_key: Path | None
    ca_cert: Path | None        # to verify the SuperLink's certificate on loopback
    workdir: Path               # pid, logs, temp files
    max_body_mb: int = 512      # one model update or object per request
    rate_limit: int = 0         # Fleet requests per second per client address; 0: no limit


def _listen(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _upstream_block(spec: ProxySpec) -> str:
    """Return the nginx directives every forwarded location shares.

    Keep-alive to the SuperLink, no buffering (model updates stream through),
    and on TLS the SuperLink's certificate verified.
    """
    lines = ["proxy_http_version 1.1;", 'proxy_set_header Connection "";', "proxy_set_header Host localhost;",
             "proxy_set_header X-Forwarded-For $remote_addr;", "proxy_buffering off;",
             "proxy_request_buffering off;", "proxy_read_timeout 300s;", "proxy_send_timeout 300s;"]
    if spec.server_cert:
        lines += [f"proxy_ssl_trusted_certificate {spec.ca_cert};", "proxy_ssl_verify on;",
                  "proxy_ssl_name localhost;", "proxy_ssl_server_name on;", "proxy_ssl_session_reuse on;"]
    return "".join(f"\n            {line}" for line in lines)


def _tls_block(spec: ProxySpec) -> str:
    if not spec.server_cert:
        return ""
    lines = [f"ssl_certificate {spec.server_cert};", f"ssl_certificate_key {spec.server_key};",
             "ssl_protocols TLSv1.2 TLSv1.3;", "ssl_prefer_server_ciphers off;"]
    return "".join(f"\n        {line}" for line in lines)


def _rate_limit(spec: ProxySpec) -> tuple[str, str]:
    """Return the ``http``-level zone and the Fleet location's rule (both empty when there is no limit).

    A SuperNode polls about once a second and fetches a model as a handful of
    object requests, so the limit is per address, sized for many devices behind
    one NAT; the burst (twice the rate) passes without delay.
    """
    if spec.rate_limit <= 0:
        return "", ""
    zone = (f"\n    limit_req_zone $binary_remote_addr zone=quorum_fleet:10m rate={spec.rate_limit}r/s;"
            "\n    limit_req_status 503;\n    limit_req_log_level warn;")
    return zone, f"\n            limit_req zone=quorum_fleet burst={2 * spec.rate_limit} nodelay;"


def render_nginx_conf(spec: ProxySpec) -> str:
    """nginx.conf text for ``spec`` (foreground master, everything under ``workdir``)."""
    w = spec.workdir
    user = "user nobody nogroup;\n" if os.geteuid() == 0 else ""
    scheme, ssl = ("https", " ssl http2") if spec.server_cert else ("http", "")
    upstream = _upstream_block(spec)
    zone, limit = _rate_limit(spec)
    return f"""# Written by `quorum aggregator start`; edits are overwritten.
{user}worker_processes 1;
daemon off;
pid {w / 'nginx.pid'};
error_log {w / 'error.log'} warn;
events {{ worker_connections 1024; }}
http {{
    access_log {w / 'access.log'};
    client_body_temp_path {w / 'tmp' / 'body'};
    proxy_temp_path {w / 'tmp' / 'proxy'};
    fastcgi_temp_path {w / 'tmp' / 'fastcgi'};
    uwsgi_temp_path {w / 'tmp' / 'uwsgi'};
    scgi_temp_path {w / 'tmp' / 'scgi'};
    server_tokens off;
    client_max_body_size {spec.max_body_mb}m;{zone}
    upstream quorum_superlink {{
        server 127.0.0.1:{spec.upstream_port};
        keepalive 32;
    }}
    server {{
        listen {_listen(spec.listen_host, spec.listen_port)}{ssl};{_tls_block(spec)}
        # The Fleet API: the device RPCs by name, POST only. The URI sent on is rebuilt
        # from the match, so the SuperLink sees the normalised path nginx checked.
        location ~ ^/v1/fleet/({"|".join(FLEET_RPCS)})$ {{
            limit_except POST {{ deny all; }}{limit}
            proxy_pass {scheme}://quorum_superlink/v1/fleet/$1;{upstream}
        }}
        location = /health {{
            limit_except GET {{ deny all; }}
            proxy_pass {scheme}://quorum_superlink/health;{upstream}
        }}
        # Control API, Runtime API, docs, anything else: never from the device side.
        location / {{
            return 403;
        }}
    }}
}}
"""


def nginx_binary() -> str:
    """Return the path of the ``nginx`` executable (Debian: ``apt-get install nginx-light``).

    Raises
    ------
    ProcessFailed
        nginx is not installed.
    """
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                           if Path(p).exists()), None)
    if found is None:
        raise ProcessFailed("nginx is not installed: it is the TLS front door that keeps the SuperLink's "
                            "Control API off the network (Debian/Ubuntu: apt-get install nginx-light)")
    return found


def nginx_command(spec: ProxySpec) -> list[str]:
    """Write ``nginx.conf`` under ``spec.workdir`` and return the command that runs it in the foreground."""
    tmp = spec.workdir / "tmp"
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:  # workers run as nobody: they need their temp dirs, nothing else
        import pwd

        nobody = pwd.getpwnam("nobody")
        for path in (tmp, *tmp.iterdir()):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
    conf = spec.workdir / "nginx.conf"
    conf.write_text(render_nginx_conf(spec))
    return [nginx_binary(), "-c", str(conf), "-p", str(spec.workdir), "-e", str(spec.workdir / "error.log")]
