"""`raytrain generate`: text from a checkpoint or exported model, printed after its prompt."""

from __future__ import annotations


def add_parser(subparsers):
    g = subparsers.add_parser("generate", help="generate text from a checkpoint or exported model")
    g.add_argument("--checkpoint", default=None, help="checkpoint directory URI")
    g.add_argument("--model", default=None, help="or an exported model directory")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json (with --checkpoint, if the data is not reachable)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--greedy", action="store_true", help="argmax decoding (default: sampling)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: all")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (the i-th of --num uses seed+i)")
    g.add_argument("--num", type=int, default=1, help="number of samples")
    return g


def run(args) -> int:
    from raytrain.generate import load

    gen = load(args.checkpoint, args.model, args.tokenizer)
    for i in range(args.num):
        text = gen(args.prompt, args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed + i)
        print(args.prompt + text)
    return 0
