"""Names of the arrays packed into the megakernel's two int32 buffers (program, device state):
the host packs them in this order (``cutemk.runtime``) and the kernel rebuilds views by index."""

PROGRAM = (
    "task_rec",
    "wait_ev",
    "wait_target",
    "notify_ev",
    "ev_count",
    "queue_ptr",
    "queue_rec",
    "cons_ptr",
    "cons_task",
    "task_nwait",
    "init_tasks",
    "rwait_ptr",
    "rwait_ev",
    "rwait_rank",
    "rwait_target",
)
DEVICE_STATE = ("state", "debug", "ev_counter", "task_pending", "ring")
P = {name: i for i, name in enumerate(PROGRAM)}
D = {name: i for i, name in enumerate(DEVICE_STATE)}
PROF_WIDTH = 4  # per task: SM, start ns, end ns, node (int64)
