"""A Kubernetes API emulator for discovery tests: kmock's, plus label selectors and fault switches.

kmock's `KubernetesEmulator` serves an in-memory API on loopback but ignores `labelSelector` on
lists and watches; a real API server applies it, so this subclass filters both (equality and
`in (...)` terms, which is what rlfleet's selector uses). Two switches let tests break the API:
`forbidden` answers lists with HTTP 403, `drop_events` swallows watch events (as a watch that
silently lost its connection would), so only a re-list can show what changed, and
`expire_watches` makes watches fail with 410 Gone.
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import kmock

_TERM = re.compile(r"\s*([^,=!\s]+)\s*(?:(==?|!=)\s*([^,\s]*)|\s+in\s+\(([^)]*)\))\s*(?:,|$)")


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for key, op, value, choices in _TERM.findall(selector or ""):
        if choices:
            ok = labels.get(key) in {c.strip() for c in choices.split(",")}
        elif op == "!=":
            ok = labels.get(key) != value
        else:
            ok = labels.get(key) == value
        if not ok:
            return False
    return True


class SelectingEmulator(kmock.KubernetesEmulator):
    forbidden = False
    drop_events = False
    expire_watches = 0  # this many next watches answer 410 Gone (resourceVersion too old) at once
    selectors: list[str]  # every labelSelector asked for, in order (set by EmulatorThread)

    def _selected(self, request, obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return selector_matches(request.params.get("labelSelector", ""), labels)

    async def _serve_list(self, request):
        self.selectors.append(request.params.get("labelSelector", ""))
        if self.forbidden:
            raise kmock.KubernetesError(status=403, reason="Forbidden", message="pods is forbidden")
        payload = await super()._serve_list(request)
        payload["items"] = [o for o in payload["items"] if self._selected(request, o)]
        return payload

    async def _serve_watch(self, request):
        if self.expire_watches > 0:
            self.expire_watches -= 1
            yield {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}
            return
        async for event in super()._serve_watch(request):
            if isinstance(event, dict) and (self.drop_events or not self._selected(request, event["object"])):
                continue
            yield event


class EmulatorThread:
    """Runs a SelectingEmulator on 127.0.0.1 in its own thread and event loop."""

    def __init__(self) -> None:
        self.url = ""
        self.emulator: SelectingEmulator | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="kmock", daemon=True)

    async def _main(self) -> None:
        async with SelectingEmulator() as emulator, kmock.Server(emulator) as server:
            emulator.resources["v1/pods"] = {}  # a known resource even before the first pod exists
            emulator.selectors = []
            self.emulator, self.url = emulator, str(server.url).rstrip("/")
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the kmock emulator did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
