"""A request's checks before it is queued: its prompt, parameters and resumed outputs against the model's
vocabulary and context. Each failure is a ``RequestError`` naming the field at fault (the services' gRPC
INVALID_ARGUMENT, HTTP 400, CLI exit 2)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import RequestError
from shared.model.tokenizer import Tokenizer
from shared.sampling import SamplingParams


@dataclass(frozen=True)
class RequestChecks:
    vocab_size: int
    max_context: int
    tokenizer: Tokenizer | None = None

    def prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (a text prompt encoded)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt", "text prompts need a tokenizer.json beside the model")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("prompt", "the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_context:
            raise RequestError("prompt", f"{len(ids)} tokens do not fit the context of {self.max_context}")
        return ids

    def request(self, prompt: str | list[int], params: SamplingParams, output_ids: list[int] = (),
                output_logprobs: list[float] = ()) -> list[int]:
        """The prompt's ids, once the prompt, the parameters and the resumed outputs all fit."""
        ids = self.prompt(prompt)
        self.resume(output_ids, output_logprobs, params)
        if len(ids) + params.max_new_tokens > self.max_context:
            raise RequestError("max_new_tokens", f"prompt ({len(ids)}) + max_new_tokens "
                               f"({params.max_new_tokens}) exceeds the context of {self.max_context}")
        bad = next((t for t in params.token_ids_used() if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError("sampling", f"token id {bad} is outside the vocabulary")
        return ids

    def resume(self, output_ids: list[int], output_logprobs: list[float], params: SamplingParams) -> None:
        """The output tokens a resuming request (a failover) brings: as many logprobs, within max_new_tokens."""
        if len(output_logprobs) != len(output_ids):
            raise RequestError("resume_logprobs", f"{len(output_logprobs)} logprobs for {len(output_ids)} tokens")
        if len(output_ids) >= params.max_new_tokens:
            raise RequestError("resume_ids", f"{len(output_ids)} tokens leave none of max_new_tokens "
                                             f"({params.max_new_tokens}) to generate")
        bad = next((t for t in output_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError("resume_ids", f"token id {bad} is outside the vocabulary")
