"""`--simulate`: the real set-up and one real training step of chosen ranks of a large world, in
one CPU process, on torch's fake process group with tensors that hold no data (docs/simulate.md).

    fake_world.py  one simulated rank's world: fake process group, meta device, restored on exit
    memory.py      live / peak bytes of every storage, saved-activation bytes; host reads answered
    rank_step.py   one rank: mesh, model chunks, DataParallel, optimizer, one train_step, measured
    planned.py     the planner's figures for the same rank (megalite.plan), side by side
    routing.py     expert parallelism: the dispatchers' host reads answered with the planner's balanced routing
    ranks.py       which ranks to simulate; every rank's groups checked against the topology
    replay.py      the verified schedule replayed with the planner's costs: the step time and its advice
    run.py         the command (`pretrain_gpt.py --simulate`): report, --simulate-json
"""
