"""The servers: one ``openai`` client per base URL, retries with backoff, and the worker threads that spread rows.

Data parallel is a shared queue: ``concurrency`` threads per server take the next row as soon as
they are free, so a slow or dead server takes fewer rows instead of holding the run up. The
``openai`` client's own retries are off (``max_retries=0``): ours also retry 425, honour
Retry-After, and turn the last failure into a :class:`RequestFailed` with the engine's message.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from dspark_precompute.errors import MissingDependencyError, RegenerateError

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 409, 425, 429})
MAX_BACKOFF = 60.0


class RequestFailed(Exception):
    """A request that got no usable answer after its retries: becomes a request_failed reject, never a stop."""


class ServerDown(RequestFailed):
    """The server could not be reached through every retry: its rows go to the other servers."""


@dataclass
class Reply:
    """One turn's answer as the engine gave it."""

    content: str
    finish_reason: str
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None
    prompt_token_ids: list[int] | None = None  # vLLM return_token_ids
    token_ids: list[int] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def _openai() -> Any:
    try:
        import openai
    except ImportError:
        raise MissingDependencyError("regenerate=server needs the openai client: pip install "
                                     "'dspark-precompute[regenerate]'") from None
    return openai


def _extra(obj: Any, key: str) -> Any:
    """A field the OpenAI schema does not name (vLLM's token ids, reasoning_content), or None."""
    value = getattr(obj, key, None)
    if value is None and isinstance(getattr(obj, "model_extra", None), dict):
        value = obj.model_extra.get(key)
    return value


def _message(resp: Any) -> tuple[Any, Any]:
    """The first choice and its message; a reply shaped otherwise is a RequestFailed naming what it lacks."""
    choices = getattr(resp, "choices", None)
    if not choices:
        raise RequestFailed(f"the server answered without choices: {str(resp)[:300]}")
    choice = choices[0]
    msg = getattr(choice, "message", None)
    if msg is None:
        raise RequestFailed(f"the server's first choice has no message: {str(choice)[:300]}")
    content = getattr(msg, "content", None)
    if content is not None and not isinstance(content, str):
        raise RequestFailed(f"the server's message content is of type {type(content).__name__}, not a string or null: "
                            f"{str(content)[:300]}; serve the OpenAI chat schema (content as text)")
    calls = getattr(msg, "tool_calls", None)
    if calls is not None and not (isinstance(calls, list) and all(hasattr(c, "model_dump") for c in calls)):
        raise RequestFailed(f"the server's message tool_calls is not a list of calls: {str(calls)[:300]}")
    return choice, msg


def parse_reply(resp: Any) -> Reply:
    """The first choice of a ChatCompletion; an answer without one, or of the wrong shape, is a RequestFailed.

    The client does not validate the schema, so a content that is a number or a list would
    otherwise be stored as the turn."""
    choice, msg = _message(resp)
    calls = [c.model_dump(exclude_none=True) for c in msg.tool_calls] if msg.tool_calls else None
    usage = getattr(resp, "usage", None)
    reasoning = _extra(msg, "reasoning_content") or _extra(msg, "reasoning")
    return Reply(content=msg.content or "", finish_reason=str(choice.finish_reason or ""),
                 reasoning=str(reasoning) if reasoning else None, tool_calls=calls,
                 refusal=getattr(msg, "refusal", None),
                 prompt_token_ids=_extra(resp, "prompt_token_ids"), token_ids=_extra(choice, "token_ids"),
                 prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
                 completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0))


class Server:
    """One OpenAI-compatible endpoint."""

    def __init__(self, base_url: str, api_key: str, timeout: float, max_retries: int, backoff: float):
        openai = _openai()
        self.base_url = base_url.rstrip("/")
        self.client = openai.OpenAI(base_url=self.base_url, api_key=api_key, timeout=timeout, max_retries=0)
        self.max_retries, self.backoff = max_retries, backoff

    def models(self) -> list[dict[str, Any]]:
        """What /v1/models lists; a server that does not answer is a RegenerateError naming it."""
        try:
            return [m.model_dump() for m in self.client.models.list().data]
        except Exception as exc:  # noqa: BLE001 - connection refused, 404, garbage: one line naming the URL
            raise RegenerateError(f"regenerate.base_urls has {self.base_url}, which does not answer GET /models "
                                  f"({type(exc).__name__}: {str(exc)[:200]}); start it or fix the URL") from None

    def ask(self, kwargs: dict[str, Any]) -> Reply:
        """One chat completion, retried on time-outs, lost connections and 408/409/425/429/5xx."""
        openai = _openai()
        attempt = 0
        while True:
            try:
                return parse_reply(self.client.chat.completions.create(**kwargs))
            except openai.APIStatusError as exc:
                status = exc.status_code
                message = f"HTTP {status} from {self.base_url}: {_body(exc)}"
                retry = status in RETRY_STATUS or status >= 500
                wait = _retry_after(exc)
            except (openai.APIConnectionError, openai.APIResponseValidationError, ValueError) as exc:
                message, retry, wait = f"{type(exc).__name__} from {self.base_url}: {str(exc)[:300]}", True, None
                if attempt >= self.max_retries and isinstance(exc, openai.APIConnectionError):
                    raise ServerDown(f"{message} (after {attempt} retries)") from None
            if not retry or attempt >= self.max_retries:
                raise RequestFailed(message if not retry else f"{message} (after {attempt} retries)")
            delay = wait if wait is not None else min(self.backoff * 2 ** attempt, MAX_BACKOFF)
            log.debug("retrying in %.2fs: %s", delay, message)
            time.sleep(delay * (1.0 + 0.1 * random.random()))
            attempt += 1


def _body(exc: Any) -> str:
    body = getattr(exc, "body", None)
    text = str(body) if body is not None else str(getattr(exc, "message", exc))
    return text[:500]


def _retry_after(exc: Any) -> float | None:
    try:
        value = exc.response.headers.get("retry-after")
        return min(float(value), MAX_BACKOFF) if value is not None else None
    except (AttributeError, ValueError):
        return None


J = TypeVar("J")
R = TypeVar("R")


class Pool:
    """``concurrency`` worker threads per server, all taking jobs from one queue.

    A server that stops answering (:class:`ServerDown`) hands its job back and its threads end, while
    another server is up; the last one up turns its failures into results, so every job gets one.
    """

    def __init__(self, servers: list[Server], concurrency: int):
        self.servers, self.concurrency = servers, concurrency
        self._lock = threading.Lock()
        self._up = set(range(len(servers)))

    def _hand_back(self, index: int) -> bool:
        """Mark server ``index`` down when another one is still up to take its job (then True)."""
        with self._lock:
            if self._up - {index}:
                self._up.discard(index)
                return True
            return False

    def run(self, jobs: Iterable[J], work: Callable[[Server, J], R]) -> Iterator[tuple[J, R | Exception]]:
        """``(job, work(server, job))`` in completion order; an exception of ``work`` is yielded as the result.

        ``jobs`` is consumed as the threads need it (a few per thread ahead), never whole: a generator
        over the paper's 1.3M rows holds only what is in flight.
        """
        todo: queue.Queue[J] = queue.Queue()
        done: queue.Queue[tuple[J, R | Exception]] = queue.Queue()
        stop = threading.Event()
        source = iter(jobs)

        def loop(index: int, server: Server) -> None:
            while not stop.is_set() and index in self._up:
                try:
                    job = todo.get(timeout=0.05)
                except queue.Empty:
                    continue
                result: R | Exception
                try:
                    result = work(server, job)
                except ServerDown as exc:
                    if self._hand_back(index):
                        log.warning("%s; its rows go to the other servers", exc)
                        todo.put(job)
                        return
                    result = exc
                except Exception as exc:  # noqa: BLE001 - handed to the caller, who decides
                    result = exc
                done.put((job, result))

        threads = [threading.Thread(target=loop, args=(i, s), daemon=True, name=f"regen-{i}")
                   for i, s in enumerate(self.servers) for _ in range(self.concurrency)]
        ahead = 2 * len(threads)
        in_flight, more = 0, True
        try:
            for t in threads:
                t.start()
            while True:
                while more and todo.qsize() < ahead:
                    try:
                        todo.put(next(source))
                        in_flight += 1
                    except StopIteration:
                        more = False
                if not in_flight:
                    return
                yield done.get()
                in_flight -= 1
        finally:
            stop.set()  # a stop (signal, error) lets the threads finish the request in hand, then end
