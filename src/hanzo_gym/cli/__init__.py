"""The `gym` command line."""

from __future__ import annotations

import argparse
import sys
import warnings

from hanzo_gym import __version__
from hanzo_gym.errors import GymError, HubPushError


def _train(args: argparse.Namespace) -> None:
    from hanzo_gym.config import load_config

    cfg = load_config(args.config)  # before torch loads: a bad config fails in a moment
    from hanzo_gym.engine.distributed import shutdown
    from hanzo_gym.loops.train import run_training

    try:
        run_training(cfg)
    finally:
        shutdown()  # under torchrun run_training joined the process group


def _preprocess(args: argparse.Namespace) -> None:
    from hanzo_gym.config import load_config
    from hanzo_gym.data.dataset import format_stats
    from hanzo_gym.loops.train import load_run_data, load_run_tokenizer

    cfg = load_config(args.config)
    data, what = load_run_data(cfg, load_run_tokenizer(cfg))
    if cfg.rl == "grpo":
        print(f"{len(data.train)} train and {len(data.val)} validation {what}")
    else:
        print(format_stats(data.stats))


def _merge(args: argparse.Namespace) -> None:
    from hanzo_gym.cli.merge import merge_run
    from hanzo_gym.config import load_config

    destination = merge_run(load_config(args.config), args.out, args.checkpoint)
    print(f"wrote merged model to {destination}")


def _push(args: argparse.Namespace) -> None:
    from hanzo_gym.loops.hub_push import push_run_dir

    url = push_run_dir(args.run_dir, args.repo_id, private=args.private or None, revision=args.revision)
    print(f"pushed {args.run_dir} to {url}")


def _report(args: argparse.Namespace) -> None:
    from hanzo_gym.cli.report import report

    report(args.run_dir, args.out)


def _vllm_serve(args: argparse.Namespace) -> None:
    from hanzo_gym.cli.vllm_serve import run_vllm_serve
    from hanzo_gym.config import load_config

    run_vllm_serve(load_config(args.config), dry_run=args.dry_run)


def _synth(args: argparse.Namespace) -> None:
    from hanzo_gym.synth.console import run_synth_command

    run_synth_command(args.design, preview=args.preview)


def _trainjob(args: argparse.Namespace) -> None:
    import os

    from hanzo_gym.cli.trainjob import main_trainjob

    main_trainjob(os.environ, dry_run=args.dry_run)


def _serve(args: argparse.Namespace) -> None:
    from hanzo_gym.serve import run_serve

    run_serve(
        args.model,
        args.adapter,
        args.host,
        args.port,
        args.renderer,
        args.served_model_name,
        args.verbose,
        args.default_max_tokens,
        args.max_request_tokens,
        args.tinker,
        args.tinker_model,
        {"auto": "auto", "true": True, "false": False}[args.bf16],
        tinker_sampler=args.tinker_sampler,
        api_keys=args.api_key,
        api_key_file=args.api_key_file,
        insecure_no_auth=args.insecure_no_auth,
    )


CONFIG_REFERENCE = "docs/config.md"
CONFIG_HELP = "the run's YAML file: Axolotl's keys (base_model, datasets, adapter, …)"


def _command(commands, name: str, summary: str, reference: str, details: str = ""):
    """A subcommand whose --help says what it does, then where its reference is."""
    return commands.add_parser(
        name, help=summary, description=f"{summary}. {details}".strip(), epilog=f"Reference: {reference}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gym",
        description="hanzo-gym: post-training of open language models (LoRA, QLoRA, full fine-tuning; SFT, "
        "preference training, GRPO) from Axolotl-style YAML, the Tinker API or HTTP.",
        epilog="Reference: README.md; `gym COMMAND --help` for each command",
    )
    parser.add_argument("--version", action="version", version=f"hanzo-gym {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    train = _command(
        commands,
        "train",
        "train from a YAML config: LoRA, QLoRA or full fine-tuning; SFT, DPO/IPO/ORPO/SimPO/KTO or GRPO",
        CONFIG_REFERENCE,
        "Writes the adapter (or model), checkpoints and metrics.jsonl to output_dir; Ctrl-C keeps the checkpoints, "
        "and the same command again continues the interrupted run (`resume_from_checkpoint: false` starts over).",
    )
    train.add_argument("config", help=CONFIG_HELP)
    train.set_defaults(handler=_train)

    preprocess = _command(
        commands,
        "preprocess",
        "tokenize the datasets and print counts (and fill dataset_prepared_path); no training",
        CONFIG_REFERENCE,
    )
    preprocess.add_argument("config", help=CONFIG_HELP)
    preprocess.set_defaults(handler=_preprocess)

    merge = _command(commands, "merge", "fold the trained adapter into the base model", "docs/commands.md")
    merge.add_argument("config", help=CONFIG_HELP)
    merge.add_argument("--out", help="destination folder (default: <output_dir>/merged)")
    merge.add_argument("--checkpoint", help="merge checkpoint-N instead of the final adapter")
    merge.set_defaults(handler=_merge)

    push = _command(
        commands,
        "push",
        "push a finished run's adapter (or full model), tokenizer and model card to the Hugging Face Hub",
        "docs/config.md, section Pushing to the Hugging Face Hub",
    )
    push.add_argument("run_dir", help="the run's output_dir")
    push.add_argument("repo_id", help="the Hub repo: owner/name, or name in your own namespace")
    push.add_argument(
        "--private", action="store_true", help="create the repo private (an existing repo stays as it is)"
    )
    push.add_argument(
        "--revision", metavar="BRANCH", help="the branch to push to (created when missing; default: main)"
    )
    push.set_defaults(handler=_push)

    report = _command(
        commands,
        "report",
        "summarise runs and draw their curves (loss, eval, learning rate, grad norm, rewards) into one PNG",
        "README.md, section Look at your run",
        "Reads only the run directory, so it works on a run still going or copied off a cluster; several runs "
        "share each chart.",
    )
    report.add_argument("run_dir", nargs="+", help="a run's output_dir; give several to compare them")
    report.add_argument(
        "--out", help="the PNG to write (default: RUN_DIR/report.png for one run, ./report.png for several)"
    )
    report.set_defaults(handler=_report)

    synth = _command(
        commands,
        "synth",
        "generate a dataset from a design YAML (samplers, LLM columns, validators)",
        "docs/synth.md",
    )
    synth.add_argument("design", help="the design YAML file")
    synth.add_argument(
        "--preview", type=int, metavar="N", help="print N rows as JSON instead of writing `output`"
    )
    synth.set_defaults(handler=_synth)

    trainjob = _command(
        commands,
        "trainjob",
        "Kubeflow TrainJob entry: train from environment variables; torchrun-ready",
        "docs/trainjob.md",
    )
    trainjob.add_argument(
        "--dry-run", action="store_true", help="print the resolved config as YAML and exit without training"
    )
    trainjob.set_defaults(handler=_trainjob)

    serve = _command(
        commands,
        "serve",
        "OpenAI-compatible server for a base model and its LoRA adapters (and, with --tinker, the Tinker API)",
        "docs/serve.md",
    )
    serve.add_argument("--model", required=True, help="base model: hub id, local folder or .gguf file")
    serve.add_argument(
        "--adapter",
        action="append",
        metavar="NAME=PATH",
        help="serve the PEFT adapter at PATH (folder or gym:// path) as model NAME; repeatable",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    serve.add_argument("--renderer", help="chat renderer (default: the model's recommended one)")
    serve.add_argument("--served-model-name", help="the base model's name in requests (default: --model)")
    serve.add_argument(
        "--default-max-tokens",
        type=int,
        help="max_tokens of a chat request that gives none (default 1024, at most the rest of the context)",
    )
    serve.add_argument(
        "--max-request-tokens",
        type=int,
        help="the most tokens one request may ask for: prompts × n × max_tokens (default 32768)",
    )
    serve.add_argument(
        "--tinker",
        action="store_true",
        help="also answer the official tinker SDK (/api/v1/*): TINKER_BASE_URL=http://HOST:PORT "
        "TINKER_API_KEY=tml-anything; checkpoints go under $HANZO_GYM_RUNS (needs pip install tinker==0.38.0)",
    )
    serve.add_argument(
        "--tinker-model",
        action="append",
        metavar="NAME=PATH",
        help="with --tinker: one more base model (hub id, folder or .gguf) that tinker clients ask for as "
        "NAME, loaded at its first use; repeatable",
    )
    serve.add_argument(
        "--tinker-sampler",
        choices=["builtin", "vllm"],
        default="builtin",
        help="with --tinker: what decodes the tinker clients' samples: the built-in sampler (default) or a vLLM "
        "colocated in the server (needs vLLM installed); log-probabilities of prompts come from the trainer",
    )
    serve.add_argument(
        "--bf16",
        choices=["auto", "true", "false"],
        default="auto",
        help="the config key's values: auto (default) is bf16 where the device multiplies it natively (a "
        "CUDA GPU, a CPU with avx512_bf16 or AMX), else fp32; the first line says which",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="accept requests carrying this key (Authorization: Bearer KEY, or X-API-Key: KEY as the tinker SDK "
        "sends it; its keys start with tml-); each key is a user, whose Tinker runs and checkpoints no other key "
        "sees; repeatable; also $VLLM_API_KEY",
    )
    serve.add_argument("--api-key-file", metavar="PATH", help="more keys, one a line (# comments)")
    serve.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve a non-loopback --host without keys: whoever reaches it may use and delete everything",
    )
    serve.add_argument("--verbose", action="store_true", help="log every request")
    serve.set_defaults(handler=_serve)

    vllm_serve = _command(
        commands,
        "vllm-serve",
        "start the vLLM server a GRPO run with `trl.vllm_mode: server` samples from (Axolotl's vllm-serve)",
        "docs/config.md, section Rollouts on vLLM (`trl.use_vllm`)",
    )
    vllm_serve.add_argument("config", help="the run's YAML file (its base model and `vllm:` block)")
    vllm_serve.add_argument("--dry-run", action="store_true", help="print the vllm command and exit")
    vllm_serve.set_defaults(handler=_vllm_serve)
    return parser


def _quiet_libraries() -> None:
    """Progress bars are for terminals; peft 0.21 trips a transformers rename warning users cannot act on."""
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    if not sys.stderr.isatty():
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        args.handler(args)
    except HubPushError as exc:  # the run is saved; only the push failed
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except GymError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        from hanzo_gym.files import disk_full

        if not disk_full(exc):
            raise
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        print(
            f"error: no space left on the disk{where}: free some space and run the same command again",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
