"""What the CPU and GPU tests of ``shared/mixed_graphs.py`` share."""

from __future__ import annotations


def record_features(engine) -> list:
    """From now on, the features each forward over prefill chunks feeds the engine's draft (float32, on the host),
    in order; an engine without a draft records none."""
    features: list = []
    w = engine.runner.speculator
    if w is not None:
        inner = w.launch_rows

        def spy(decode, starts, prefill, out, *rest):
            features.append(out.features().float().cpu())
            return inner(decode, starts, prefill, out, *rest)

        w.launch_rows = spy
    return features


def run_late_prompt(engine, short: list[list[int]], long: list[int], params):
    """``short`` decode two steps, then ``long`` arrives and prefills in chunks beside them. Returns each request's
    tokens, the logits rows sampled for it (float32 on the host, stacked) and ``record_features``' list."""
    import torch

    logits: dict[str, list] = {}
    features = record_features(engine)
    inner = engine.runner._sample_and_commit

    def spy(out, reqs, *rest):
        for req, row in zip(reqs, out.logits):
            logits.setdefault(req.rid, []).append(row.float().cpu())
        return inner(out, reqs, *rest)

    engine.runner._sample_and_commit = spy
    early = [engine.add_request(p, params) for p in short]
    engine.step()
    engine.step()
    late = engine.add_request(long, params)
    engine.run_until_done()
    reqs = early + [late]
    return [engine.result(q).token_ids for q in reqs], [torch.stack(logits[q.rid]) for q in reqs], features
