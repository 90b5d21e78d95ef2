"""A request of several choices (OpenAI's ``n`` and ``best_of``): what the router's core fans out and merges.

Each choice is a request of its own to the engines (id ``{rid}#{i}``: ``#`` is not allowed in a client's id,
so no client request can take it), with its own Redis record, placement, failover and abort, walked by
``RouterCore`` like any request; the request's record (``req:{rid}``) ends when every choice has. With a seed,
choice i samples with ``seed + i`` (mod 2^64): it is the one-choice request with that seed, token for token;
without one, each choice draws its own seed (independent samples). The choices prefer one decode (and one
prefill) instance: the least loaded when the request arrived (``RouterCore._pick``'s ``prefer``); a choice goes
elsewhere only when that instance cannot take it. An abort names the request (``Abort`` with its id, a client
hanging up) and ends every choice; one choice failing for good ends the others (recorded "aborted", naming it).

The choices' messages reach the client as they come, each naming its choice (``index``); with ``best_of`` > n
every choice runs to its end first, then the n of highest cumulative log-probability (the sum of the engine's
per-token logprobs of the sampled tokens, which the router always receives) go out, best first, one message
each, indexed 0..n-1 by rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from proto.eyrie.v1 import eyrie_pb2 as pb
from services.router.session import merge
from shared.sampling import SamplingParams

SEED_MODULUS = 2**64  # seeds are uint64 on the wire


def choice_counts(req: pb.GenerateRequest) -> tuple[int, int]:
    """(n, best_of) of ``req``: n 0 means 1, best_of 0 means n."""
    n = req.n or 1
    return n, req.best_of or n


def choice_rid(rid: str, index: int) -> str:
    return f"{rid}#{index}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: the request's, its seed (when given) plus ``index``."""
    if params.seed is None or index == 0:
        return params
    return params.model_copy(update={"seed": (params.seed + index) % SEED_MODULUS})


async def pump(run: AsyncIterator[pb.GenerateResponse], rid: str, index: int, queue: asyncio.Queue) -> None:
    """Choice ``index``'s messages into ``queue`` as (index, message), named after the request ``rid``; then
    (index, None) at its end, or (index, the exception) that ended it."""
    try:
        async for out in run:
            out.request_id, out.index = rid, index
            queue.put_nowait((index, out))
        queue.put_nowait((index, None))
    except BaseException as e:  # noqa: BLE001 (the merging side raises it)
        queue.put_nowait((index, e))
        if not isinstance(e, Exception):
            raise


async def merged(queue: asyncio.Queue, count: int) -> AsyncIterator[pb.GenerateResponse]:
    """The messages ``count`` pumps put in ``queue``, as they come, until each has ended; the first error
    raised."""
    left = count
    while left:
        _, item = await queue.get()
        if item is None:
            left -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield item


def best_choices(messages: list[pb.GenerateResponse], n: int, return_logprobs: bool) -> list[pb.GenerateResponse]:
    """The ``n`` choices of ``messages`` with the highest cumulative logprob (ties: the lower index), best
    first, each as one message indexed by its rank; their logprobs kept only when the client asked."""
    whole = {}
    for index in dict.fromkeys(m.index for m in messages):
        whole[index] = merge([m for m in messages if m.index == index])
    ranked = sorted(whole, key=lambda i: (-sum(whole[i].logprobs), i))[:n]
    # The prompt's cached tokens are the request's: the fewest any choice found (the one that computed the prompt
    # may not be among the best; ``openai_http._usage`` takes the fewest of those returned)
    cached = min((m.finish.usage.cached_tokens for m in whole.values() if m.HasField("finish")), default=0)
    out = []
    for rank, index in enumerate(ranked):
        msg = whole[index]
        msg.index = rank
        if msg.HasField("finish"):
            msg.finish.usage.cached_tokens = cached
        if not return_logprobs:
            del msg.logprobs[:]
        out.append(msg)
    return out
