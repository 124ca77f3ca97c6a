"""The fault drill's write window is held on a file (issue 40): deterministic, whatever the load."""
import threading

from megalite.checkpoint import save


def test_a_writer_waits_in_the_window_while_the_drill_is_armed(tmp_path, monkeypatch):
    monkeypatch.setenv(save.WRITE_HOLD_ENV, str(tmp_path))
    assert save.hold_if_armed(0) is False  # not armed: no wait, nothing written
    (tmp_path / "arm").touch()
    held = []
    writer = threading.Thread(target=lambda: held.append(save.hold_if_armed(3)))
    writer.start()
    for _ in range(2000):  # the drill's poll: the writer says it is inside the window
        if (tmp_path / "held_r3").exists():
            break
        writer.join(0.005)
    assert (tmp_path / "held_r3").exists() and writer.is_alive()  # still held: the victim is signalled now
    (tmp_path / "arm").unlink()  # disarm
    writer.join(10)
    assert held == [True] and not writer.is_alive()
