"""A local S3 endpoint for the object-storage tests: moto's server over HTTP on a free port,
in a process of its own, with s3fs (through meshtrain) as the client.

Run as a script it serves until killed and prints its port. Between the client and moto
sits a switch the test sets through a JSON file (`control`), to make the bucket behave
as real ones sometimes do:

    {"stall": "checkpoint-4/"}   uploads whose key holds this wait (a slow link) and are
                                 recorded in `<control>.stalled`, so the test can kill a
                                 writer in the middle of a save
    {"refuse": "checkpoint-6/"}  uploads whose key holds this are refused (403 AccessDenied,
                                 as a bucket policy or a full quota answers)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

BUCKET = "meshtrain-test"
STALL_S = 600


def _switch(app, control: Path):
    """WSGI middleware: stall or refuse the uploads the control file names."""

    def serve(environ, start_response):
        method, key = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        rules = json.loads(control.read_text()) if control.is_file() else {}
        if method in ("PUT", "POST") and rules.get("refuse") and rules["refuse"] in key:
            body = (
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
                b"<Message>Access Denied</Message></Error>"
            )
            start_response("403 Forbidden", [("Content-Type", "application/xml")])
            return [body]
        if method in ("PUT", "POST") and rules.get("stall") and rules["stall"] in key:
            with control.with_suffix(".stalled").open("a") as log:
                log.write(key + "\n")
            time.sleep(STALL_S)
        return app(environ, start_response)

    return serve


def serve(control: Path) -> None:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app = _switch(DomainDispatcherApplication(create_backend_app), control)
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


def client_env(port: int) -> dict[str, str]:
    """The environment an S3 client (s3fs, boto3) reads its endpoint and credentials from."""
    return {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


@contextmanager
def s3_server(folder: Path):
    """Start the server, make the bucket, set the client environment in this process;
    yields the control file."""
    control = folder / "s3-control.json"
    server = subprocess.Popen(
        [sys.executable, __file__, str(control)], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(server.stdout.readline())
        env = client_env(port)
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        _wait_for(port)
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield control
    finally:
        server.kill()
        server.wait()
        for name, value in locals().get("saved", {}).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _wait_for(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
