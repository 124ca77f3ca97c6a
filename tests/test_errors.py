"""UsageError: printed once on rank 0 as one line, exit code 2; `comm.agreed` gives every rank
the verdict of a check that failed on one rank only (no rank left waiting in a collective)."""
import io

from megalite.distributed import comm, mesh
from megalite.data import DataFileNotFoundError
from megalite.errors import USAGE_EXIT_CODE, UsageError, report_usage_error
from megalite.testing import run_distributed


def test_report_prints_one_line_on_rank_0_only():
    streams = [io.StringIO(), io.StringIO()]
    error = UsageError("--data-path x: x.idx does not exist;\n  create it with tools/preprocess_data.py")
    assert [report_usage_error(error, rank, streams[rank]) for rank in (0, 1)] == [USAGE_EXIT_CODE] * 2 == [2, 2]
    assert streams[0].getvalue() == ("megalite: --data-path x: x.idx does not exist; create it with "
                                     "tools/preprocess_data.py\n")
    assert streams[1].getvalue() == ""


def _check_on_one_rank(kind):
    m = mesh.init_mesh()

    def check():
        if m.rank == 1 and kind == "usage":
            raise DataFileNotFoundError("data.idx does not exist; build it with tools/preprocess_data.py")
        if m.rank == 1 and kind == "bug":
            raise KeyError("oops")
        return m.rank

    try:
        result = comm.agreed(check, comm.world_group())
    except Exception as exc:  # noqa: BLE001
        result = (type(exc).__name__, str(exc))
    comm.barrier(comm.world_group())  # every rank is still in step: the next collective completes
    return result


def test_agreed_raises_on_every_rank():
    assert run_distributed(_check_on_one_rank, 2, "none") == [0, 1]
    usage = ("DataFileNotFoundError", "data.idx does not exist; build it with tools/preprocess_data.py")
    assert run_distributed(_check_on_one_rank, 2, "usage") == [usage, usage]
    rank0, rank1 = run_distributed(_check_on_one_rank, 2, "bug")
    assert rank1 == ("KeyError", "'oops'") and rank0 == ("RuntimeError", "rank 1 failed: KeyError: 'oops'")
