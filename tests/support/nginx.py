"""Test helper: run a real nginx (the Debian package) in front of one server, or several replicas, on loopback.

The shipped ``deploy/nginx/ttft-sse.conf`` is what runs: only its listen port and its replicas' ports are replaced,
and it is included into a minimal main config whose paths (pid, logs, temp) all live in a temporary folder.
nginx runs in the foreground (``daemon off``) as a child of the test and is stopped by its PID; a system nginx,
if any, is never touched.
"""

from __future__ import annotations

import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.support.processes import system_binary
from tests.support.servers import free_port

SHIPPED = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "ttft-sse.conf"

# A proxy as it comes: nothing configured for streaming (buffering on, HTTP/1.0 upstream). Whether events still
# stream through it depends on what the service's own response headers say.
DEFAULT_PROXY = """
server {
    listen 80;
    location / {
        proxy_pass http://127.0.0.1:8000;
    }
}
"""


def nginx_binary() -> str:
    return system_binary("nginx", "nginx")


# The replica lines of an upstream block: `server 127.0.0.1:PORT [parameters];`, one after another.
SERVER = r"[ \t]*server[ \t]+127\.0\.0\.1:\d+[^;\n]*;\n"
SERVERS = re.compile(rf"(?m)^([ \t]*)server[ \t]+127\.0\.0\.1:\d+([^;\n]*);\n(?:{SERVER})*")


def site_config(text: str, *, listen: int, upstreams: Sequence[int]) -> str:
    """``text`` with its one ``listen`` port pointed at ``listen``, and its replicas at ``upstreams``: the
    upstream block's run of ``server`` lines becomes one line per port (with the first line's parameters); a
    config without one (a plain ``proxy_pass``) takes exactly one port."""
    text, listens = re.subn(r"(?m)^(\s*listen\s+)\d+;", rf"\g<1>{listen};", text)
    assert listens == 1, f"expected one listen port, found {listens}"
    blocks = list(SERVERS.finditer(text))
    if blocks:
        assert len(blocks) == 1, "expected one run of upstream server lines"
        indent, params = blocks[0].group(1), blocks[0].group(2)
        lines = "".join(f"{indent}server 127.0.0.1:{port}{params};\n" for port in upstreams)
        return text[: blocks[0].start()] + lines + text[blocks[0].end() :]
    assert len(upstreams) == 1, "a config without an upstream block proxies to one server"
    text, found = re.subn(r"127\.0\.0\.1:8000\b", f"127.0.0.1:{upstreams[0]}", text)
    assert found == 1, f"expected one upstream address, found {found}"
    return text


def main_config(folder: Path, site: Path) -> str:
    return f"""
daemon off;
worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {folder}/access.log;
    client_body_temp_path {folder}/client_body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    include {site};
}}
"""


@contextmanager
def nginx(upstream_port: int | Sequence[int], *, site: str | None = None, start_timeout: float = 30) -> Iterator[str]:
    """Run nginx with ``site`` (default: the shipped config) in front of ``127.0.0.1:upstream_port`` (or of one
    replica per port, given several).

    Yields the proxy's base URL.
    """
    ports = [upstream_port] if isinstance(upstream_port, int) else list(upstream_port)
    binary = nginx_binary()
    port = free_port()
    text = SHIPPED.read_text() if site is None else site
    with tempfile.TemporaryDirectory(prefix="ttft-nginx-") as tmp:
        folder = Path(tmp)
        site_path = folder / "site.conf"
        site_path.write_text(site_config(text, listen=port, upstreams=ports))
        (folder / "nginx.conf").write_text(main_config(folder, site_path))
        args = [binary, "-p", str(folder), "-c", str(folder / "nginx.conf"), "-e", str(folder / "error.log")]
        check = subprocess.run([*args, "-t"], capture_output=True, text=True)
        assert check.returncode == 0, f"nginx rejects the config:\n{check.stderr}"
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + start_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"nginx exited with {proc.returncode}: {proc.stderr.read().decode()}")  # type: ignore[union-attr]
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "nginx did not start listening"
                    time.sleep(0.02)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()  # SIGTERM to the master we started: fast shutdown of it and its workers
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            if proc.stderr is not None:
                proc.stderr.close()
