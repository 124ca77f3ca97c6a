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
from megalite._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "megalite.data.default_corpus": ["build_default_corpus", "stdlib_documents"],
    "megalite.data.gpt_dataset": ["BlendedDataset", "GPTDataset", "blend_assignment", "build_gpt_datasets",
                                  "parse_data_path", "parse_split", "split_documents"],
    "megalite.data.indexed_dataset": ["CorruptIndexError", "DataError", "DataFileNotFoundError", "IndexedDataset",
                                      "IndexedDatasetWriter"],
    "megalite.data.mock_dataset": ["MockDataset", "build_mock_datasets"],
    "megalite.data.preprocess": ["preprocess_documents", "preprocess_files"],
    "megalite.data.sampler": ["EvalSampler", "GlobalBatchSampler", "collate", "eval_indices",
                              "load_microbatches"],
    "megalite.data.tokenizer": ["ByteTokenizer", "HFTokenizer", "load_tokenizer"],
})
