"""Data pipeline: tokenizers, memory-mapped indexed datasets, GPT samples, blending, sampling.

Typical use in a training script:

    tokenizer = load_tokenizer(args.tokenizer)                     # None -> byte level
    train, valid, test = build_gpt_datasets(args.data_path, args.split, seq_length, seed, tokenizer)
    sampler = GlobalBatchSampler(len(train), global_batch_size, micro_batch_size,
                                 mesh.dp_rank, mesh.dp_size, consumed_samples=resumed)
    for step, microbatches in zip(range(train_iters), sampler):
        batches = load_microbatches(train, microbatches)          # [{"input_ids", "labels"}, ...]

Names are imported lazily (PEP 562), so tools/preprocess_data.py starts without importing torch.
"""
import importlib

_EXPORTS = {
    "megalite.data.default_corpus": ["build_default_corpus", "stdlib_documents"],
    "megalite.data.gpt_dataset": ["BlendedDataset", "GPTDataset", "blend_assignment", "build_gpt_datasets",
                                  "parse_data_path", "parse_split", "split_documents"],
    "megalite.data.indexed_dataset": ["CorruptIndexError", "DataError", "DataFileNotFoundError", "IndexedDataset",
                                      "IndexedDatasetWriter"],
    "megalite.data.preprocess": ["preprocess_documents", "preprocess_files"],
    "megalite.data.sampler": ["EvalSampler", "GlobalBatchSampler", "collate", "eval_indices",
                              "load_microbatches"],
    "megalite.data.tokenizer": ["ByteTokenizer", "HFTokenizer", "load_tokenizer"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'megalite.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return __all__
