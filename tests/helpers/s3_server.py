"""A real S3-protocol server on loopback for the storage tests: moto's server (``moto[server]``)
in its own process on a free port, stopped by its process id."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_server():
    """Yields the env vars (AWS_ENDPOINT_URL, keys, region) that point boto/s3fs at the server."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def s3_environment():
    """:func:`moto_server` with its env vars set in this process (s3fs and entropylens' filesystem
    caches cleared on the way in and out, the previous env restored): ``with s3_environment(): ...``."""
    import s3fs

    from entropylens import storage

    with moto_server() as env:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        storage._FS_CACHE.clear()
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            yield env
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            storage._FS_CACHE.clear()
            s3fs.S3FileSystem.clear_instance_cache()
