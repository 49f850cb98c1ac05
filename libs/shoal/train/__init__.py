"""``shoal.train``: make a PyTorch training script elastic with a few lines.

User's side (in the spirit of EDL's listing 1)::

    import shoal.train as st

    job = st.init()                                    # 1. initialise
    model, opt = Net().to(job.device), torch.optim.SGD(...)
    job.register(model, opt)                           # 2. state to broadcast / checkpoint
    job.elastic_sampler(len(X), global_batch_size=64)  # 3. each sample once per epoch
    for step in job.train(epochs=5):                   # 4. the loop; resizes happen between steps
        loss = F.cross_entropy(model(X[step.indices]), y[step.indices])
        loss.backward()
        job.step(loss)                                 # 5. all-reduce, optimizer step, batch hook

The same script runs unchanged under torchrun (a fixed world on the default
process group) or as a single process: ``init()`` looks at its environment.

Design
======

Control plane: one trainer sidecar per job per node (``services/trainer_sidecar``,
``--mode real``). The job's sidecars elect a leader with a lease in JetStream KV
(:class:`shoal.bus.LeaderLease`); the leader runs the :class:`~shoal.train.controller.Controller`,
which starts the worker processes (the user's script, with ``SHOAL_TRAIN_*``
variables and per-worker visible devices), hosts a ``TCPStore`` for rendezvous and
a JSON-lines control server (:mod:`shoal.train.protocol`), and turns each
``Reconfigure(epoch, gpus)`` into a new *generation*: a membership (worker ids in
rank order) with its own process group under its own store prefix.
Workers run on the nodes the placement names: the leader starts those of its own
node as its children and those of another node through that node's sidecar of the
job, which runs them as its children and reports their exits
(:mod:`shoal.train.launch`, ``services/trainer_sidecar/remote.py``); every worker
connects back to the leader's control server and store by address.

Leader handover (EDL §4.2): a leader whose node leaves the job scales in to the other
nodes, then detaches (:meth:`~shoal.train.controller.Controller.detach`) without killing the
survivors, which keep training in their process group (gloo's connections are
between the workers; the store is needed only to build a group; the NCCL path has
not been run).
The next leader adopts them in place (:meth:`~shoal.train.controller.Controller.adopt`);
each worker finds the new control server in ``leader.json`` in the checkpoint
directory (``SHOAL_TRAIN_LEADER`` names the leader it knows). Nothing is reloaded.
A leader that is killed takes its own workers with it; that is a worker failure.

Data plane: workers hold process groups (gloo on CPU, NCCL on GPU) built directly
from the store, with a timeout on every collective and rendezvous. Each step does
one all-reduce of a flat buffer: the gradients, each scaled by the worker's sample
count, plus four control slots (samples, loss, announced generation, stop flag).
Dividing by the global sample count makes the update exactly the single-process
update on the same global batch, and the control slots make every worker learn a
switch or a stop in the *same* step, with no clock agreement and no extra
collective.

Data: :class:`~shoal.train.data.ElasticSampler`. The permutation of a data epoch
is a pure function of (seed, epoch); the cursor is synchronised state. Each step's
global batch is the next slice of the permutation and each worker takes its
contiguous share, so every sample is processed exactly once per data epoch
however often the job is resized (EDL §4.3), with no RPC on the hot path.
Strong scaling (fixed global batch, per-worker batch = global / world) is the
default; weak scaling within a range is an option.

Three ways to change shape, chosen by the controller:

* **Stop-free scale-out** (EDL §4.2): new workers start, import torch, build the
  model and data and join the next generation's rendezvous while the old workers
  keep training (they build the new group on a background thread). When every
  member is ready the leader commits the switch at step
  ``t_cur + ceil(T_a / T_b)`` (``T_a`` = 500 ms); rank 0 announces it in that step's
  control slot, all switch at its end, and one old worker broadcasts model,
  optimizer and data progress. Only the broadcast stops training.
* **Graceful scale-in**: the same commit; leaving workers exit at the boundary,
  the others adopt the pre-built group. No broadcast, no stop beyond a group swap
  (CoDDL's zero-cost shrinking).
* **Checkpoint-restart** (SideCar): SIGTERM makes every worker stop at the next
  step (a stop flag in the control slot); rank 0 writes the checkpoint; the job is
  restarted on the new device set and restores it. Used for scripts that do not
  use this API, when asked for, and for recovery.

Cancellation (CoDDL §4.3): a newer epoch cancels a pending generation at the
earliest safe point: before the commit, by killing the not-yet-joined workers
and dropping the pre-built groups; after it, by an abort that rank 0 accepts
unless it has already announced the switch (then the switch completes and the new
order applies on top). No worker waits on anything without a deadline.

Failures: a worker that dies makes its peers' collective fail at once (gloo sees
the closed connection) or after the collective timeout; the controller handles it
as a forced scale-in: consistent recovery restarts the survivors from the last
periodic checkpoint (EDL §4.2). With ``SHOAL_TRAIN_RECOVERY=approximate`` (a per-job
option) the survivors instead re-form a group at once, without a reload, and redo
the failed step's all-reduce with their own gradients: the dead worker's share of
that one batch is lost, which DNN training tolerates (EDL §4.2).

Gradients live in one flat buffer (each ``p.grad`` is a view of it, as DDP's
``gradient_as_bucket_view``), so a step costs one all-reduce and no copies.

Leaving workers and workers stopped for a checkpoint end with ``os._exit(0)`` at
the batch boundary: their state lives on in the other workers or the checkpoint,
and a clean interpreter exit can wait seconds on process-group destructors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shoal.train.config import TrainConfig
from shoal.train.data import ElasticSampler, Scaling

if TYPE_CHECKING:
    from shoal.train.runtime import ElasticJob, Step

__all__ = ["ElasticJob", "ElasticSampler", "Scaling", "Step", "TrainConfig", "init"]


def init(config: TrainConfig | None = None) -> ElasticJob:
    """Start the job's runtime: elastic under shoal, torchrun's world, or one process.

    Raises:
        ValueError: a ``SHOAL_TRAIN_*`` variable is malformed.
        ConnectionError: the sidecar named by ``SHOAL_TRAIN_CONTROL`` does not answer.
    """
    from shoal.train.runtime import ElasticJob

    return ElasticJob(config or TrainConfig.from_env())


def __getattr__(name: str) -> Any:
    if name in ("ElasticJob", "Step"):
        from shoal.train import runtime

        return getattr(runtime, name)
    raise AttributeError(name)
