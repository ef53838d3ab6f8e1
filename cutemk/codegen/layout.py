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

# The live-count table of a kernel compiled for one capture at every token count
# (``KernelSpec.live``): a header, a lookup from the live token count to a plan (-1: none in
# this kernel), and per plan a row of where its program and device state lie in the kernel's
# concatenated buffers, with its scalars. ``max``: the largest count this kernel serves;
# ``limit``: the largest count any kernel of the caller serves (one regime's kernel skips the
# counts of the next); ``bad``/``last_bad`` count launches whose live count was outside
# [0, limit].
LIVE_HEADER = ("max", "bad", "last_bad", "lookup", "rows", "num_plans", "limit")
LIVE_ROW = (
    "prog_off",
    "prog_len",
    "dev_off",
    "dev_len",
    "num_tasks",
    "num_init",
    "max_epoch",
    "tokens",
)
LH = {name: i for i, name in enumerate(LIVE_HEADER)}
LR = {name: i for i, name in enumerate(LIVE_ROW)}
LIVE_HEADER_WORDS = 8
