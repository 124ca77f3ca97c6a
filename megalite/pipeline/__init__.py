"""Pipeline parallelism: layer partitioning, schedules as data, a verifier, one executor.

    stage_layers(num_layers, pp, v, pp_rank, first=None, last=None, layout=None) -> list[range]
    build_schedule(name, pp, num_microbatches, v=1) -> list[list[Instr]]
    verify_schedule(schedule, pp, v, num_microbatches)            # raises ScheduleError
    check_pipeline_config(name, num_layers, pp, num_microbatches, v=1, first=None, last=None, layout=None)
    run_pipeline(spec, model_chunks, microbatches, mesh, loss_scale=1.0, *, grad_sync=None, ...) -> float
    Pipeline(stages, mesh, loss_fn, ...).step(microbatches, loss_scale, grad_sync=...)   # a user's own stages

Everything but the executor is pure arithmetic (no torch); names load lazily (PEP 562), so the
planner uses partition, schedules and the verifier without loading torch.
"""
from megalite._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "megalite.pipeline.executor": ["GradSync", "PipelineSpec", "allreduce_shared_embedding_grads", "post_and_wait",
                                   "run_pipeline"],
    "megalite.pipeline.instructions": ["BWD", "BWD_INPUT", "BWD_WEIGHT", "FWD", "RECV_ACT", "RECV_GRAD", "SEND_ACT",
                                       "SEND_GRAD", "Instr", "Schedule", "format_schedule"],
    "megalite.pipeline.partition": ["chunk_layer_counts", "model_chunk_id", "parse_layout", "stage_layers"],
    "megalite.pipeline.schedules": ["SCHEDULES", "build_schedule", "check_pipeline_config", "check_schedule_args",
                                    "verified_schedule"],
    "megalite.pipeline.stages": ["Pipeline", "Stage", "split_layers"],
    "megalite.pipeline.verifier": ["ScheduleError", "peak_live_microbatches", "verify_schedule"],
})
