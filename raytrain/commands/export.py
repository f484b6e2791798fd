"""`raytrain export`: a checkpoint (any ZeRO stage) -> a Hugging Face model directory."""

from __future__ import annotations


def add_parser(subparsers):
    ex = subparsers.add_parser("export", help="checkpoint -> Hugging Face model directory (any ZeRO stage)")
    ex.add_argument("--checkpoint", required=True, help="checkpoint directory URI (see `raytrain ckpt list`)")
    ex.add_argument("--out", required=True, help="output directory: local path or s3://...")
    ex.add_argument("--tokenizer", default=None, help="tokenizer.json if the training data is not reachable")
    ex.add_argument("--force", action="store_true", help="overwrite an existing model directory")
    ex.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                    help="precision of the exported weights (default: the one the run trained in)")
    ex.add_argument("--adapter", action="store_true", help="LoRA runs: write the PEFT adapter directory (adapter_config.json, "
                    "adapter_model.safetensors; the base beside it in base/ unless model.init_from names it) instead of "
                    "the merged model")
    return ex


def run(args) -> int:
    from raytrain.export import export

    export(args.checkpoint, args.out, tokenizer=args.tokenizer, force=args.force, adapter=args.adapter,
           dtype=args.dtype)
    return 0
