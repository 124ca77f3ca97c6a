"""The mesh and its groups: rank arithmetic (topology), the process groups (mesh, layer_groups,
torch_mesh), the one communication choke point (comm) and its byte ledger (ledger), the job's
rendezvous, and the guard against host reads inside a step (host_reads)."""
