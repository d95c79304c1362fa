"""``straggler.straggler_ctrlr_port``: Megatron's run-time switch of the straggler detector.

Megatron's protocol (megatron.core.utils.StragglerDetector): rank 0 listens on the port; any HTTP request (``curl
host:port``) asks to toggle detection and is answered ``Will turn StragglerDetector ON|OFF at next logging
interval``. At the next logging step every rank joins a broadcast of rank 0's new state, so all ranks switch
together; several requests before that step make one toggle. Port 0 lets the OS choose a free port (logged).

Unlike Megatron (every interface) the server listens on localhost unless given another host: toggling is for
someone on the training node, and the port stays closed to the network.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from longspan.core.logging import get_logger

logger = get_logger(__name__)

DEFAULT_HOST = "127.0.0.1"


class StragglerController:
    """Rank 0's HTTP listener: requests set a pending toggle that ``take_toggle_request`` hands over once.

    ``is_enabled()`` tells the listener the detector's state, for its answer."""

    def __init__(self, port: int, is_enabled: Callable[[], bool], host: str = DEFAULT_HOST) -> None:
        self._requested = threading.Event()
        self._is_enabled = is_enabled
        self._closed = False
        controller = self

        class _Handler(BaseHTTPRequestHandler):
            def _toggle(self) -> None:
                controller._requested.set()
                state = "OFF" if controller._is_enabled() else "ON"
                body = f"Will turn StragglerDetector {state} at next logging interval".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
                logger.info(body.decode())

            do_GET = do_POST = do_PUT = _toggle

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass  # each request is logged once by _toggle, not on stderr

        self._server = ThreadingHTTPServer((host, int(port)), _Handler)
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="straggler-controller", daemon=True)
        self._thread.start()
        logger.info(f"straggler detector: toggle it with a request to http://{self.host}:{self.port} "
                    f"(now {'ON' if is_enabled() else 'OFF'})")

    def take_toggle_request(self) -> bool:
        """Whether a toggle was requested since the last call (the request is consumed)."""
        if self._requested.is_set():
            self._requested.clear()
            return True
        return False

    def close(self) -> None:
        """Stop listening and free the port (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        if self in _current:
            _current.remove(self)


#: the listener of this process's current run: a run that failed before closing its own (an in-process restart
#: sets up again in the same process) must not keep the port from the next one
_current: list[StragglerController] = []


def start_controller(port: int, is_enabled: Callable[[], bool], host: str = DEFAULT_HOST) -> Optional[StragglerController]:
    """The listener on ``port``, or None with one warning when the port cannot be bound (as Megatron goes on)."""
    while _current:
        _current.pop().close()
    try:
        controller = StragglerController(port, is_enabled, host)
        _current.append(controller)
        return controller
    except OSError as exc:
        logger.warning(f"straggler.straggler_ctrlr_port={port}: the straggler detector cannot be controlled "
                       f"({exc}); detection goes on as it started")
        return None


def agree_on_toggle(requested: bool, device: Any = "cpu") -> bool:
    """Collective on every rank at the same logging step: rank 0's ``requested``, broadcast to all ranks."""
    flag = torch.tensor([int(requested)], device=device)
    if dist.is_initialized():
        dist.broadcast(flag, src=0)
    return bool(flag.item())
