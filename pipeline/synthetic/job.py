"""The scheduled synthetic-data job: a seed set x templates x samples, generated once per time slot
by the same driver, workers and writer as jobs/generate.py.

The slot (schedule.py) comes from `--slot` or the schedule's clock. For one slot:

1. Expand (pure, no I/O): the seeds chosen for the slot (all, or `seeds_per_slot` picked by a hash
   of (slot, seed id)) x the templates that apply to each seed's kind x `samples` per template ->
   one input row each: id `<seed_id>/<template>/<sample>` (the same in every slot), the rendered
   `prompt`, a per-row `seed` = hash(run.seed, slot, id), the template's temperature/max_tokens/
   stop overrides, and `slot`, `seed_id`, `template`, `sample`. Sampled generation by default
   (temperature > 0): each row draws from its own generator seeded by (seed, id), so rerunning a
   slot regenerates the same rows, and other slots draw other samples of the same prompts.
2. A committed slot (its `_SUCCESS` exists) ends here, before any write or model check. Else the
   models and output location are checked, then the slot is claimed: the slot lease
   `<slot>/_lease/` (pipeline/io/lease.py, reused; `_SUCCESS` is checked again once it is held).
   Why a slot lease beside run_job's run lease: run_job, called on a complete run, finalizes it
   again (rewrites manifest.json and _SUCCESS), so "is the slot done?" and the run must happen
   under one claim for a late second run to change nothing. Its first generation is
   an atomic create -- a hard link on local disks, a PUT with `If-None-Match: *` on S3 (AWS, MinIO,
   moto); on stores or S3 servers without conditional writes, storage.create_exclusive's fallback
   (exists-check, write, read-back after a settle delay: two claims within that delay can both
   pass). Of two runs started at once exactly one wins; the other commits nothing and exits 0
   naming the holder. A holder that died (its pid gone on this host, or no heartbeat for
   run.lease_ttl_s) is taken over: the new run resumes the committed units of the first.
3. Write the expanded rows once to `<slot>/_input/rows-<digest>.parquet` (exclusive create). The
   digest of the rows is in the name: an uncommitted slot whose `_input/` holds another expansion
   (seed set, templates, samples) is refused before anything is written, and another config with
   the same rows is refused by run_job's plan guard, naming the keys; two expansions never mix.
4. run_job (pipeline/cluster/driver.py) with input.path = that file, output.path = the slot
   folder, run.run_id = `synthetic-<slot>` and input.passthrough_columns = slot, seed_id, template:
   every completions/rounds/errors row carries its slot. run_job's own run lease, plan guard,
   resume and manifest apply unchanged.
5. Quality gate (quality.py): `curated/` and `kept/` beside the run, then the dataset card and
   provenance (card.py), `summary.json`, then `_SUCCESS` in the slot folder, last. A slot is committed once its `_SUCCESS` exists; a later run
   for it, whatever its config, reads summary.json, changes nothing and exits 0 ("already committed
   by run ..."). An uncommitted slot started with another config or expansion is refused (exit 2).

Stages (`synthetic.stages`): steps 3-5 run once per stage, in order, each in its own folder
`stage=<id>/` with its own run (`synthetic-<slot>-<id>`), curated/ and kept/ tables, summary.json and
`_SUCCESS`: a stage commits once, and a rerun after a crash skips the committed stages (their
kept rows are the next stage's input, read back) and redoes only the rest. A later stage's rows
are expanded from the kept rows of its input stage (stages.py); a judge stage's curated rows are
the rows it judged with its score columns (quality.curate_judged). The slot's `_SUCCESS` comes
after the last stage, the dataset card and provenance.

Layout under `<output.path>/slot=<slot>/` (hive-style: `slot=` and `stage=` folders):

    _lease/                                   the slot's claim (hidden: "_" prefix)
    _input/rows-<digest>.parquet              a stage's expanded input
    synthetic-<slot>/                         a stage's run, as jobs/generate.py writes it
    curated/<unit>.parquet                    completions + prompt, sample and quality columns
    kept/<unit>.parquet                       the kept rows (what the card points at)
    near_duplicates.parquet                   the rows' MinHash signatures (later slots check against them)
    README.md, provenance.json                the dataset card and what made it (card.py)
    summary.json, _SUCCESS                    the slot's counts; written last

With stages, the five stage entries above live under `stage=<id>/` (runs `synthetic-<slot>-<id>`),
each with its own summary.json and `_SUCCESS`; the card, provenance, summary and `_SUCCESS` of the
slot stay at its top.

Knows the seed set, templates, slots and the output layout; knows nothing about models or tensors
(run_job does the generating).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..io.lease import LeaseHeld, acquire, describe_holder, owner_info
from ..io.writer import RunOutput
from .plan import SlotFolder, SlotPlan
from .stage_run import StageRunner


@dataclass
class SlotResult:
    status: str                             # committed | already_committed | busy
    message: str
    summary: dict | None = None             # the last stage's run_job summary (committed by this run only)
    slot_summary: dict | None = None        # summary.json


def already_message(slot: str, done: dict) -> str:
    return (f"slot {slot} already committed by run {done['run_id']} at {done['committed_at']} "
            f"(pid {done['committed_by'].get('pid')} on {done['committed_by'].get('host')}); "
            f"nothing to do: {done['output']}")


def busy_message(slot: str, holder: str) -> str:
    return (f"slot {slot} is being generated by another run ({holder}); this run commits nothing: the "
            f"holder commits the slot, or, if it dies, the next run for the slot resumes its committed units")


def run_slot(plan: SlotPlan, stop=None, say=print) -> SlotResult:
    """Generate and commit one slot, exactly once, stage by stage (see the module docstring). Raises
    what run_job raises (InputError, OutputError before any work; JobFailed, Interrupted after)."""
    from ..cluster.driver import JobFailed, check_models
    storage = plan.cfg.storage.with_environment()
    folder = SlotFolder(plan.url, storage)
    done = folder.committed()                      # the common repeat: no write at all
    if done is not None:
        return SlotResult("already_committed", already_message(plan.slot, done), slot_summary=done)
    check_models(plan.job)
    RunOutput(plan.url, plan.run_id, storage).check_location()
    owner = owner_info(slot=plan.slot, run_id=plan.run_id)
    try:
        lease = acquire(folder.fs, folder.p("_lease"), owner, plan.cfg.run.lease_ttl_s, folder.retry)
    except LeaseHeld as e:
        return SlotResult("busy", busy_message(plan.slot, describe_holder(e.holder)))
    try:
        lease.start_heartbeats()
        done = folder.committed()                  # committed while we were claiming it
        if done is not None:
            return SlotResult("already_committed", already_message(plan.slot, done), slot_summary=done)
        runner = StageRunner(plan, storage, stop, say)
        try:
            for sp in plan.stages:
                if runner.run(sp) is None:
                    return SlotResult("busy", busy_message(plan.slot, runner.busy))
        finally:
            runner.close()
        if lease.lost.is_set():
            raise JobFailed(f"the slot lease was lost ({lease.lost_reason}); slot {plan.slot} not marked "
                            f"committed; rerun to finish it")
        slot_summary = runner.commit_slot(folder, owner)
    finally:
        lease.release()
    return SlotResult("committed", f"slot {plan.slot} committed by run {plan.run_id}: {plan.url}",
                      runner.last_run, slot_summary)
