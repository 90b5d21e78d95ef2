"""The ``eyrie`` command line: generate, make-model, train-draft, and (with the services) serve / up / client.

Bad input exits with status 2 and one line naming the problem.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

EXIT_USAGE = 2
PACKAGE = "eyrie-serve"


def _fail(message: str) -> None:
    print(f"eyrie: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default (the settings-derived flags write theirs themselves)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "(default:" in text:
            return text
        if action.required:
            return f"{text} (required)"
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        return f"{text} (default: {'unset' if action.default is None else '%(default)s'})"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, exit 2
        _fail(message)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    def of(package: str) -> str:
        try:
            return installed(package)
        except PackageNotFoundError:
            return "not installed"

    return f"eyrie {of(PACKAGE)} (torch {of('torch')}, Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="eyrie", description="LLM serving with lossless EAGLE speculative decoding")
    p.add_argument("--version", action="version", version=version())
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text with the single-process engine")
    add_generate_flags(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("make-model", help="write a random-weight checkpoint (target + draft heads)")
    m.add_argument("--preset", default="tiny", help="model shape (shared/model/factory.py PRESETS)")
    m.add_argument("out_dir", help="directory to write: target/, eagle/, eagle3/ and mtp/ under it")
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    m.add_argument("--fp8", choices=("channel", "block"), help="write the target as an FP8 checkpoint: "
                   "`channel` = compressed-tensors (per-channel weight scales, dynamic per-token activations, as "
                   "RedHatAI's *-FP8-dynamic), `block` = the fp8 format with 128x128 weight blocks (as Qwen3's and "
                   "DeepSeek-V3's); norms, embeddings, the LM head and the draft heads stay unquantized")
    m.set_defaults(func=cmd_make_model)

    t = sub.add_parser("train-draft", help="train an EAGLE-3, EAGLE or multi-layer draft head for a target")
    t.add_argument("--target", required=True, help="target checkpoint directory (with tokenizer.json)")
    t.add_argument("--corpus", required=True, nargs="+",
                   help="text files, directories, JSONL of {\"text\"} or chat {\"messages\"}")
    t.add_argument("--kind", default="eagle3", choices=["eagle3", "eagle", "mtp"], help="the head to train")
    t.add_argument("--out", required=True, help="the head's directory (load it with --draft)")
    for flag, kind, default, about in TRAIN_FLAGS:
        t.add_argument(flag, type=kind, default=default, help=about)
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    t.add_argument("--device", default="cpu", help="`cpu` or `cuda` (`cuda:N`)")
    t.add_argument("--dtype", default="float32", help="the target's and the written head's dtype")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train_draft)

    try:
        from services.launch import add_service_commands
    except ImportError:
        pass
    else:
        add_service_commands(sub)
    return p


TRAIN_FLAGS = (  # flag, type, default, help: the numeric settings of train-draft (TrainConfig's fields)
    ("--steps", int, 1000, "optimiser steps"),
    ("--lr", float, 3e-4, "peak learning rate (warm-up, then cosine decay to a tenth)"),
    ("--batch-tokens", int, 8192, "tokens per step (windows of --seq-len)"),
    ("--seq-len", int, 512, "tokens per window"),
    ("--ttt-steps", int, 7, "unrolled draft steps trained (a multi-layer draft gets one layer each)"),
    ("--eval-every", int, 200, "steps between evaluations of acceptance on held-out text (0: start and end)"),
    ("--save-every", int, None, "steps between checkpoints (default: with every evaluation)"),
    ("--draft-vocab", int, None, "EAGLE-3 draft vocabulary size, the most frequent corpus tokens (default: "
                                 "min(32000, target vocabulary))"),
    ("--seed", int, 0, "initialisation and batch order"),
    ("--heldout", float, 0.05, "fraction of documents held out for evaluation"),
    ("--warmup", int, 50, "warm-up steps"),
    ("--eval-prompts", int, 8, "held-out prompts the acceptance is measured on"),
    ("--eval-prompt-len", int, 32, "tokens per held-out prompt"),
    ("--eval-new-tokens", int, 32, "tokens generated per held-out prompt"),
    ("--eval-spec-steps", int, None, "draft chain depth of the measurement (default: min(ttt-steps, 5))"),
    ("--log-every", int, 10, "steps between loss records"),
    ("--regenerate", int, 0, "replace the last N tokens of every training window by the target's greedy "
                             "continuation (train on what the target itself writes)"),
    ("--max-windows", int, None, "train on at most N windows of the corpus (a seeded choice; bounds "
                                 "--regenerate's cost, and tokenizing: only a seeded sample of documents "
                                 "holding them and 128 tokens per draft-vocabulary id is tokenized)"),
    ("--time-budget-s", float, None, "stop training (evaluate and save) after this many seconds"),
)


def cmd_train_draft(args) -> int:
    from shared.model.loader import CheckpointError
    from shared.training.corpus import CorpusError
    from shared.training.trainer import TrainConfig, TrainError, train_draft

    settings = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, *_ in TRAIN_FLAGS}
    cfg = TrainConfig(target=args.target, corpus=args.corpus, out=args.out, kind=args.kind, resume=args.resume,
                      device=args.device, dtype=args.dtype, progress=not args.no_progress, **settings)
    try:
        summary = train_draft(cfg, chat_renderer(args.target))
    except (TrainError, CorpusError, CheckpointError) as e:
        _fail(str(e))
    print(json.dumps(summary))
    return 0


def chat_renderer(target: str):
    """The target's chat template rendering whole conversations, or None when it has none."""
    from services.router.openai_http import ChatTemplate

    template = ChatTemplate(target) if (Path(target) / "config.json").exists() else None
    if template is None or template.source is None:
        return None
    return lambda messages: template.render(messages, add_generation_prompt=False)


def cmd_make_model(args) -> int:
    from shared.model.factory import make_model

    try:
        out = make_model(args.preset, args.out_dir, args.seed, fp8=args.fp8)
    except ValueError as e:
        _fail(str(e))
    print(out)
    return 0


GENERATE_ABOUT = {"model": "target checkpoint directory", "spec_topk": "draft tree: top-k per step (1 = chain; "
                  "with --draft)"}


def add_generate_flags(g: argparse.ArgumentParser) -> None:
    """The engine's flags (from the settings model, as ``eyrie serve`` has them), the prompts and sampling."""
    from services.settings import EngineOptions, add_flags
    from shared.sampling import SamplingParams

    add_flags(g, EngineOptions, defaults={"model": "a tiny model made on the fly, removed on exit"},
              about=GENERATE_ABOUT)
    g.add_argument("--config", metavar="FILE",
                   help="a YAML, JSON or KEY=VALUE file of the engine's settings (flags win over the "
                        "environment, the environment over the file)")
    g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    g.add_argument("--prompt-ids", action="append", help="prompt as comma-separated token ids (repeatable)")
    g.add_argument("--stop-token-ids", help="comma-separated token ids that end generation")
    sampling = SamplingParams.model_fields
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt at most")
    g.add_argument("--temperature", type=float, default=sampling["temperature"].default, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=sampling["top_k"].default, help="sample among the k likeliest "
                                                                                 "tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=sampling["top_p"].default, help="nucleus sampling threshold")
    g.add_argument("--seed", type=int, help="seed of the request's draws (unset: one chosen at admission)")
    g.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    g.add_argument("--json", action="store_true",
                   help="one JSON object per prompt (with a draft: its statistics, 'spec', and those of "
                        "each verify step it took part in, 'spec_batches')")


def cmd_generate(args) -> int:
    prompts, settings, config, params = _generate_inputs(args)
    with contextlib.ExitStack() as cleanup:  # the tiny model, when one is made, is removed on exit
        model, draft = _checkpoints(settings, cleanup)
        try:
            engine = _generate_engine(model, draft, config, cleanup)
            stats = engine.spec_stats
            if stats is not None:
                stats.keep_batches(None)  # one bounded run: every verify step's statistics
            results = engine.generate(prompts, params)
        except (ValueError, OSError) as e:  # a bad request or setting (RequestError), a checkpoint Eyrie cannot
            _fail(str(e))  # load (CheckpointError) or read: one line naming it
    _print_results(args, results, stats.batches_since(0) if stats is not None else None)
    if engine.spec_policy is not None:
        print(shape_summary(engine.spec_policy.steps_by_kind(), f"{engine.spec_policy.kind} policy"), file=sys.stderr)
    return 0


def shape_summary(steps: dict[str, int], who: str) -> str:
    """One line naming the kind of decode step (a tree shape, or plain) ``who`` (a speculation policy) ran most,
    from its steps by kind (``SpecPolicy.steps_by_kind``, or the ``eyrie_spec_decode_num_steps_total`` series)."""
    total = sum(steps.values())
    if total == 0:
        return f"[{who}: no decode step]"
    kind = max(steps, key=steps.get)
    rest = ", ".join(f"{k} {n}" for k, n in sorted(steps.items(), key=lambda kv: -kv[1]) if n and k != kind)
    return f"[{who} ran {kind} most: {steps[kind]} of {total} decode steps" + (f"; {rest}" if rest else "") + "]"


def _generate_engine(model, draft, config, cleanup: contextlib.ExitStack):
    """The engine of ``eyrie generate``. With ``tensor_parallel`` N > 1 this process is rank 0 of N: ranks 1 ..
    N - 1 start as processes that follow this one's engine (``follow_generate``), and end with it."""
    from shared.engine import Engine

    n = config.tensor_parallel
    if n == 1:
        return Engine(model, draft, config)
    from shared.model.config import ModelConfig
    from shared.parallel import check_split, free_address, init_group, start_ranks

    check_split(ModelConfig.from_dir(model), n)
    address = free_address()
    ranks = start_ranks(range(1, n), n, address, config.device, follow_generate, (model, draft, config))
    tp = init_group(n, 0, address, config.device)
    cleanup.callback(_end_group, ranks)
    engine = Engine(model, draft, config, tp=tp)
    cleanup.callback(engine.release_graphs)  # before the group ends (NCCL's destroy waits on live graphs)
    cleanup.callback(engine.release_followers)  # before that
    return engine


def follow_generate(tp, model, draft, config) -> None:
    """A rank other than 0 of ``eyrie generate``: a ``Follower`` of rank 0's engine, printing nothing."""
    from shared.follower import Follower

    Follower(model, draft, config, tp=tp).follow()  # its graphs dropped as it returns, before the group ends


def _end_group(ranks: list) -> None:
    from shared.parallel import leave_group

    leave_group()
    for p in ranks:
        p.join(timeout=30)


def _generate_inputs(args):
    """The prompts, the engine settings and config, and the sampling parameters of ``eyrie generate`` (exit 2
    naming the field on bad input)."""
    from pydantic import ValidationError

    from services.settings import EngineOptions, SettingsFileError, describe_error, given_flags, load_settings
    from shared.sampling import SamplingParams

    prompts: list = list(args.prompt or [])
    try:
        prompts += [[int(t) for t in ids.split(",") if t.strip()] for ids in args.prompt_ids or []]
        stop_ids = tuple(int(t) for t in args.stop_token_ids.split(",")) if args.stop_token_ids else ()
    except ValueError:
        _fail("--prompt-ids / --stop-token-ids: expected comma-separated integers")
    if not prompts:
        _fail("prompt: give --prompt TEXT or --prompt-ids IDS")
    flags = given_flags(args, EngineOptions.model_fields)
    try:
        settings = load_settings(EngineOptions, args.config, **flags)
        config = settings.engine_config()
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                                stop_token_ids=stop_ids)
    except ValidationError as e:
        _fail(describe_error(e, flags))
    except SettingsFileError as e:
        _fail(f"--config: {e}")
    return prompts, settings, config, params


def _checkpoints(settings, cleanup: contextlib.ExitStack) -> tuple:
    """The target and draft directories. Without a model: the tiny trained pair, its EAGLE-3 head included
    unless ``--draft none`` (``shared/model/default_pair.py``), or a random tiny target made in a temporary
    directory that ``cleanup`` removes."""
    model, draft = settings.model, settings.draft
    if model is None:
        from shared.model.default_pair import trained_tiny_pair
        from shared.model.factory import make_model

        trained = trained_tiny_pair()
        if trained is not None:
            model = trained.target
            draft = draft if "draft" in settings.model_fields_set else trained.eagle3
        else:
            tmp = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="eyrie-tiny-")))
            model = make_model("tiny", tmp) / "target"
    check_checkpoints(model, draft)
    return model, draft


def check_checkpoints(model, draft) -> None:
    """Exit 2 naming the flag when ``model`` or ``draft`` is not a checkpoint directory."""
    for name, path in (("--model", model), ("--draft", draft)):
        if path is not None and not (Path(path) / "config.json").exists():
            why = "no config.json" if Path(path).is_dir() else "no such directory"
            _fail(f"{name}: {path} is not a checkpoint directory ({why})")


def _print_results(args, results: list, batches: list | None) -> None:
    """One line (``--json``: one object) per prompt; with a draft, the verify batches on stderr (``--json``:
    each prompt's in its object)."""
    for r in results:
        if args.json:
            obj = r.as_json()
            if batches is not None:
                obj["spec_batches"] = [b.as_dict() for b in batches if r.rid in b.request_ids]
            print(json.dumps(obj))
        else:
            print(r.text)
            if r.spec_stats:
                st = r.spec_stats
                print(f"[accept length {st['accept_length']:.2f}, accept rate {st['accept_rate']:.2f}]",
                      file=sys.stderr)
    if batches is not None and not args.json:
        from shared.spec.stats import summarize_batches

        s = summarize_batches(batches)
        print(f"[{s['verify_batches']} verify batches, mean batch size {s['mean_batch_size']:.2f}, "
              f"accept length {s['accept_length']:.2f}, accept rate {s['accept_rate']:.2f}, "
              f"draft {s['draft_time_s']:.3f}s, verify {s['verify_time_s']:.3f}s]", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
