"""Pretrain a GPT with tensor x pipeline x data parallelism.

    python examples/pretrain_gpt.py                                   # tiny GPT, embedded corpus, CPU ok
    torchrun --nproc_per_node 8 examples/pretrain_gpt.py --tp 2 --pp 2 --dp 2
    torchrun ... examples/pretrain_gpt.py --model gpt2-124m --data-path my_corpus_text_document --bf16
    python examples/pretrain_gpt.py --config run.toml --print-config  # the resolved configuration
    python examples/pretrain_gpt.py --model llama-70b --tp 8 --pp 8 --dp 16 --simulate  # docs/simulate.md

The job itself lives in the library (`megalite.training.loop`; `megalite.commands` sends
--simulate to megalite.simulate instead), so it is the same whether you run this script or call `megalite.training.loop.train(cfg)` from your own code:

1. the flags (Megatron-LM's names; `--config FILE` for a TOML/JSON file, flags override it)
   become a `megalite.config.RunConfig`, resolved for this world and validated on every rank
   before any process group exists: a mistake ends with one message naming the fix, exit 2;
2. the mesh, the data, this rank's model chunks, the data-parallel wrapper and the optimizer;
3. resume from the newest intact checkpoint of --load (saved under any layout);
4. the steps, with periodic evaluation, checkpoints and metrics; SIGTERM/SIGUSR1 save and stop;
5. everything released at the end, or on an error or Ctrl-C.

One command line serves the first start and every restart:

    torchrun --max-restarts 3 ... examples/pretrain_gpt.py --save ckpt --load ckpt --save-interval 100
"""
import sys

from megalite.commands import main  # the stop signals handled before torch is imported

if __name__ == "__main__":
    sys.exit(main())
