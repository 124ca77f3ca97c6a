"""Data pipeline: tokenizers, memory-mapped indexed datasets, GPT samples, blending, sampling.

Typical use in a training script:

    tokenizer = load_tokenizer(args.tokenizer)                     # None -> byte level
    train, valid, test = build_gpt_datasets(args.data_path, args.split, seq_length, seed, tokenizer)
    sampler = GlobalBatchSampler(len(train), global_batch_size, micro_batch_size,
                                 mesh.dp_rank, mesh.dp_size, consumed_samples=resumed)
    for step, microbatches in zip(range(train_iters), sampler):
        batches = load_microbatches(train, microbatches)          # [{"input_ids", "labels"}, ...]
"""
from megalite.data.default_corpus import build_default_corpus, stdlib_documents
from megalite.data.gpt_dataset import (BlendedDataset, GPTDataset, blend_assignment, build_gpt_datasets,
                                       parse_data_path, parse_split, split_documents)
from megalite.data.indexed_dataset import CorruptIndexError, IndexedDataset, IndexedDatasetWriter
from megalite.data.preprocess import preprocess_documents, preprocess_files
from megalite.data.sampler import EvalSampler, GlobalBatchSampler, collate, eval_indices, load_microbatches
from megalite.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "BlendedDataset", "ByteTokenizer", "CorruptIndexError", "EvalSampler", "GPTDataset", "GlobalBatchSampler",
    "HFTokenizer", "IndexedDataset", "IndexedDatasetWriter", "blend_assignment", "build_default_corpus",
    "build_gpt_datasets", "collate", "eval_indices", "load_microbatches", "load_tokenizer", "parse_data_path",
    "parse_split", "preprocess_documents", "preprocess_files", "split_documents", "stdlib_documents",
]
