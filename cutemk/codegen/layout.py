"""Names of the arrays packed into the megakernel's two int32 buffers (program, device state):
the host packs them in this order (``cutemk.runtime``) and the kernel rebuilds views by index."""

PROGRAM = (
    "queue_head",  # first: at a fixed offset (``lower.first_offset``), read without the header
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
DEVICE_STATE = ("state", "debug", "ev_counter", "task_pending", "ring")  # state first: its
# offset is fixed too (``lower.first_offset``)
P = {name: i for i, name in enumerate(PROGRAM)}
D = {name: i for i, name in enumerate(DEVICE_STATE)}
# per task (int64): SM and node (node << 32 | SM), start ns (the consumers took its record),
# end ns (published), then its phases: fetched ns (the producer took it up), armed ns (its
# loads that may precede its events issued, each into a free ring slot), ready ns (its events
# met), landed ns (a ring tile's first slice in shared memory, as its consumers first saw it),
# staged ns (a ring tile's consumers done: its output staged for the storer); 0: not recorded
PROF_WIDTH = 8
PROF_SM_NODE, PROF_START, PROF_END, PROF_ARMED = 0, 1, 2, 3
PROF_FETCHED, PROF_READY, PROF_LANDED, PROF_STAGED = 4, 5, 6, 7
# per CTA, after the tasks' records: SM, entry ns, roles done ns, exit ns, ring slices issued
CTA_SLICES = 4
SLICE_WIDTH = 4  # per ring slice (``profile="slices"``): issued ns, landed ns, task, 0

# The live-count table of a kernel compiled for one capture at every token count
# (``KernelSpec.live``): a header, a lookup from the live token count to a plan (-1: none in
# this kernel), and per plan a row of where its program and device state lie in the kernel's
# concatenated buffers, with its scalars, then the value at its count of each token-dependent
# extent (``KernelSpec.live``'s third index; the token count itself first). ``max``: the
# largest count this kernel serves; ``limit``: the largest count any kernel of the caller
# serves (one regime's kernel skips the counts of the next); ``first``: the smallest count
# this kernel serves (at least 1); ``bad``/``last_bad`` count launches whose live count was
# outside [0, limit]; ``count_rows``: where each count in [first, max] has a copy of its
# plan's row, which the kernel reads (the lookup and the per-plan rows are the host's view).
LIVE_HEADER = (
    "max",
    "bad",
    "last_bad",
    "lookup",
    "rows",
    "num_plans",
    "limit",
    "first",
    "count_rows",
)
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
LIVE_HEADER_WORDS = 16


def live_row_width(live) -> int:
    """Words of a plan's row in the live table of a kernel binding ``live`` ((value, dim,
    extent) triples, ``KernelSpec.live``): ``LIVE_ROW``, then one per extent."""
    return len(LIVE_ROW) + 1 + max(j for _, _, j in live)  # -1 (the live count) has no word
