"""Pipeline parallelism: layer partitioning, schedules as data, a verifier, one executor.

    stage_layers(num_layers, pp, v, pp_rank, first=None, last=None, layout=None) -> list[range]
    build_schedule(name, pp, num_microbatches, v=1) -> list[list[Instr]]
    verify_schedule(schedule, pp, v, num_microbatches)            # raises ScheduleError
    check_pipeline_config(name, num_layers, pp, num_microbatches, v=1, first=None, last=None, layout=None)
    run_pipeline(name, model_chunks, microbatches, mesh, num_microbatches, activation_shape,
                 dtype, loss_scale, virtual_stages=1, stats=None) -> float
"""
from megalite.pipeline.executor import (allreduce_shared_embedding_grads, check_pipeline_config, run_pipeline,
                                       verified_schedule)
from megalite.pipeline.instructions import (BWD, BWD_INPUT, BWD_WEIGHT, FWD, RECV_ACT, RECV_GRAD, SEND_ACT,
                                            SEND_GRAD, Instr, Schedule, format_schedule)
from megalite.pipeline.partition import chunk_layer_counts, model_chunk_id, parse_layout, stage_layers
from megalite.pipeline.schedules import SCHEDULES, build_schedule, check_schedule_args
from megalite.pipeline.verifier import ScheduleError, peak_live_microbatches, verify_schedule

__all__ = [
    "BWD", "BWD_INPUT", "BWD_WEIGHT", "FWD", "RECV_ACT", "RECV_GRAD", "SEND_ACT", "SEND_GRAD", "SCHEDULES",
    "Instr", "Schedule", "ScheduleError", "allreduce_shared_embedding_grads", "build_schedule",
    "check_pipeline_config", "check_schedule_args", "chunk_layer_counts", "format_schedule", "model_chunk_id", "parse_layout",
    "peak_live_microbatches", "run_pipeline", "stage_layers", "verified_schedule", "verify_schedule",
]
