"""A reference receiver for torchpass credit notices: what a billing team can copy, and what the
tests use.

It checks the signature and timestamp (`torchpass.contract.billing.verify`), accepts each
idempotency key once and answers a repeat as a duplicate, so that a retried, replayed or duplicated
notice never becomes a second credit. Answers:

- 200 `{"accepted": true, "idempotency_key": ...}` the first time a key is seen
- 200 `{"duplicate": true, "idempotency_key": ...}` every later time
- 401 `{"error": ...}` bad or missing signature, or a stale timestamp
- 400 / 411 / 413 a body that is not a notice, has no length or is too large
- 503 for the first `fail_first` requests, to show (and test) the sender's retries

Run it: `TORCHPASS_BILLING_WEBHOOK_SECRET=... python -m torchpass.dev.billing_receiver --port 8088
--ledger credits.json` (a secret of at least 16 characters). The ledger file keeps accepted keys
across a restart; `--in-memory` instead must be asked for, since a notice replayed after a restart
would then be accepted again. A request must arrive within 10 s; a body over 1 MiB, or an absurd
Content-Length or timestamp, is refused with a 4xx answer.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

from pydantic import ValidationError

from torchpass.contract.billing import (
    DEFAULT_TOLERANCE_S,
    IDEMPOTENCY_HEADER,
    SignatureRejected,
    verify,
)
from torchpass.contract.credit import CreditNotice

_MAX_BODY_BYTES = 1024 * 1024
MIN_SECRET_CHARS = 16
Answer = tuple[int, dict[str, Any]]


class CreditLedger:
    """Accepted notices by key; persisted to a JSON file if given one, so deduplication survives
    restarts."""

    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._entries: dict[str, Any] = {}
        if path is not None and path.exists():
            self._entries = json.loads(path.read_text())

    def accept(self, notice: CreditNotice) -> bool:
        """Record the notice; False if its key was accepted before. Check and record are one
        step."""
        with self._lock:
            if notice.idempotency_key in self._entries:
                return False
            self._entries[notice.idempotency_key] = notice.model_dump(mode="json")
            self._save()
            return True

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def _save(self) -> None:
        if self._path is None:
            return
        # Write-then-rename: a crash mid-write leaves the old ledger, never a half-written one.
        tmp = self._path.with_suffix(self._path.suffix + ".tmp")
        with tmp.open("w") as f:
            json.dump(self._entries, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)


class BillingReceiver:
    """In-process: `with BillingReceiver(secret) as r:` post to `r.url`, then read `r.accepted`."""

    def __init__(
        self,
        secret: str,
        ledger: Path | None = None,
        fail_first: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        tolerance_s: float = DEFAULT_TOLERANCE_S,
        read_timeout: float = 10.0,
    ) -> None:
        self.read_timeout = read_timeout
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the webhook secret must have at least {MIN_SECRET_CHARS} characters")
        self._secret = secret
        self._tolerance_s = tolerance_s
        self._fail_first = fail_first
        self._ledger = CreditLedger(ledger)
        self._lock = threading.Lock()
        self.attempts = 0
        self.accepted: list[CreditNotice] = []
        self.duplicates: list[str] = []
        self.rejected: list[str] = []
        self._server = _Server((host, port), self)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/credits"

    def handle(self, body: bytes, headers: Mapping[str, str]) -> Answer:
        """One request's answer; the HTTP layer only reads the body and writes this back."""
        with self._lock:
            self.attempts += 1
            attempt = self.attempts
        if attempt <= self._fail_first:
            return 503, {
                "error": f"failing on purpose: attempt {attempt} of the first {self._fail_first}"
            }
        try:
            verify(body, headers, self._secret, self._tolerance_s)
            notice = CreditNotice.model_validate_json(body)
        except SignatureRejected as e:
            return self._reject(401, str(e))
        except ValidationError as e:
            return self._reject(400, f"not a credit notice: {e.error_count()} invalid fields")
        key = {k.lower(): v for k, v in headers.items()}.get(IDEMPOTENCY_HEADER.lower())
        if key != notice.idempotency_key:
            return self._reject(400, f"{IDEMPOTENCY_HEADER} header does not match the notice's key")
        return self._record(notice)

    def _record(self, notice: CreditNotice) -> Answer:
        key = notice.idempotency_key
        if self._ledger.accept(notice):
            with self._lock:
                self.accepted.append(notice)
            return 200, {"accepted": True, "idempotency_key": key}
        with self._lock:
            self.duplicates.append(key)
        return 200, {"duplicate": True, "idempotency_key": key}

    def _reject(self, status: int, reason: str) -> Answer:
        with self._lock:
            self.rejected.append(reason)
        return status, {"error": reason}

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (the command line); tests use start/stop
        instead."""
        try:
            self._server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self._server.server_close()

    def start(self) -> BillingReceiver:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="billing-receiver", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> BillingReceiver:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], receiver: BillingReceiver) -> None:
        self.receiver = receiver
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # Headers: http.server reads at most 100 of at most 64 KiB each.

    def setup(self) -> None:
        super().setup()
        # The time a client may take to send its request: a silent one never holds a thread for
        # long.
        self.connection.settimeout(self.server.receiver.read_timeout)

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._answer(411, {"error": "Content-Length required"})
        elif len(length) > 10 or int(length) > _MAX_BODY_BYTES:
            self._answer(413, {"error": f"body over {_MAX_BODY_BYTES} bytes"})
        else:
            body = self.rfile.read(int(length))
            self._answer(*self.server.receiver.handle(body, dict(self.headers.items())))

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        # the receiver's lists are the record; stderr lines per request would only be noise in tests
        pass


def serve(
    port: int, secret: str, path: Path | None = None, host: str = "127.0.0.1", fail_first: int = 0
) -> None:
    """Serve until interrupted, deduplicating into the ledger file at `path` (in memory without
    one)."""
    receiver = BillingReceiver(secret, ledger=path, fail_first=fail_first, host=host, port=port)
    print(f"billing receiver on {receiver.url}, ledger {path or 'in memory'}", flush=True)
    receiver.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--port", type=int, default=8088)
    p.add_argument("--host", default="127.0.0.1")
    dedupe = p.add_mutually_exclusive_group(required=True)
    dedupe.add_argument(
        "--ledger", type=Path, help="JSON file of accepted notices: dedupe survives restarts"
    )
    dedupe.add_argument(
        "--in-memory",
        action="store_true",
        help="forget accepted keys on restart (a replayed notice would then be accepted again): "
        "demos only",
    )
    p.add_argument(
        "--fail-first", type=int, default=0, help="answer the first N requests with 503 (demos)"
    )
    args = p.parse_args(argv)
    # The secret comes from the environment, never argv, which every user of the host can read in
    # ps.
    secret = os.environ.get("TORCHPASS_BILLING_WEBHOOK_SECRET")
    if not secret:
        p.error("set TORCHPASS_BILLING_WEBHOOK_SECRET to the secret the control worker signs with")
    if len(secret) < MIN_SECRET_CHARS:
        p.error(
            f"TORCHPASS_BILLING_WEBHOOK_SECRET must have at least {MIN_SECRET_CHARS} characters"
        )
    serve(args.port, secret, args.ledger, args.host, args.fail_first)


if __name__ == "__main__":
    main()
