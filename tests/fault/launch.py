#!/usr/bin/env python3
"""Runs one injected fault under mpiexec and checks how the job ends.

For each fault: the exit status of mpiexec is non-zero; every surviving rank reports the expected
error text; the time from the faulty step to each rank's error stays within the bound (the
timeout plus the watchdog's grace period and a margin for timeout faults); no rank's guard words
were overwritten. The fault table in docs/reliability.md lists the same faults (--check-doc) and
is printed from real runs with --table.

  launch.py --mpiexec mpiexec --driver build/tests/fault_driver --fault stall -n 4
  launch.py --mpiexec mpiexec --driver build/tests/fault_driver --table -n 4
  (with --fault F: that row alone)
  launch.py --check-doc docs/reliability.md
  (device faults: --device-driver build/tests/device_fault_driver)

--mpi openmpi (with --mpiexec mpiexec.openmpi and its --mpiexec-flags) checks the rows as Open MPI
ends them where they differ from MPICH: see LAUNCHERS and each fault's 'openmpi' entry.
"""
import argparse
import os
import re
import subprocess
import sys
import shlex
import time

# What differs between the launchers: Hydra (MPICH's mpiexec) and ORTE (Open MPI's mpirun). Both
# end the whole job when one rank dies, unless told to keep the others running ('keep_going').
LAUNCHERS = {
    'mpich': dict(name='Hydra', keep_going=['-disable-auto-cleanup']),
    'openmpi': dict(name="Open MPI's mpirun", keep_going=['--mca', 'orte_abort_on_non_zero_status', '0']),
}

# What every rank of host 0 reports when host 1's only trainer stops making its steps (the two
# claim-*-hosts faults, stalled or dead alike).
CLAIM_ACROSS_HOSTS = [
    r'(?m)adaptive: step \d+: timed out after \d+ ms \(FLEXCOMM_TIMEOUT\); {stalled}not answered by world rank {f}$',
    r'across hosts: host 1 makes step \d+, and its courier, world rank {f}, sends it to this host']

# What leads a timeout's cause where the ranks waited on were followed (core/stall.hpp): the ranks
# that stopped, with their roles and states; {stalled} in an expected text.
STALLED = r'(?:stalled at [^\n]*; )?'

# How the driver behaves for each fault (tests/fault/fault.cpp); {f} is the faulty (last) rank,
# {others} the other ranks as the report lists them, {n} the world size.
def handover_rows(suffix, feed, how, **differs):
    """handover-stall and handover-dies under another feed (-suffix): the same rows, `how` it feeds."""
    timed_out = [r'timed out after \d+ ms \(FLEXCOMM_TIMEOUT\); [^\n]*world rank {f}']
    common = dict(dict(driver='adapter', min_ranks=4, survivors='target', kind='timeout', guards=False,
                       expect=timed_out, reports='as handover-stall: rank 0 names world rank {f}'), **differs)
    return {
        f'handover-stall-{suffix}': dict(common, what=f"handover-stall under {feed} {how}", mpiexec=[]),
        f'handover-dies-{suffix}': dict(common, what=f"handover-dies under {feed} (mpiexec told to keep the job: "
                                                  "{keep_going})", mpiexec='keep_going'),
    }


# What the partner of a stalled trainer says, its member averaging in shared memory (sync-stall*).
SYNC_STALL_PARTNER = (r'shared-memory allreduce.*rank 0 \(world {p}\).*timed out after \d+ ms.*'
                      r'not arrived: world rank {f} \(rank 1, at step \d+\)')

FAULTS = {
    'none': dict(
        what='no fault (control: the driver can succeed)',
        mpiexec=[], survivors='all', kind='none', succeeds=True,
        expect=[r'finished every step', r'guards intact'],
        reports='finished every step'),
    'exit': dict(
        what='rank {f} exits mid-step (mpiexec told to keep the job: {keep_going})',
        mpiexec='keep_going', survivors='others', kind='timeout',
        expect=[r'mpi iallreduce on world #7 \(1000 x float, sum\): timed out after \d+ ms \(FLEXCOMM_TIMEOUT\)',
                r'ranks that did not arrive: {f} \(world {f}\)',
                r'rank {f} \(world {f}\): no answer within \d+ ms',
                r'flight recorder of .world.'],
        reports='timed out in `iallreduce` #7; ranks that did not arrive: {f}; flight recorder'),
    'exit-cleanup': dict(
        what='rank {f} exits mid-step (plain mpiexec)',
        mpiexec=[], survivors='none', kind='hydra',
        expect=[],
        reports='nothing: mpiexec ({launcher}) kills the job at once'),
    'exit0': dict(
        what='rank {f} calls exit(0) mid-step (plain mpiexec)',
        mpiexec=[], survivors='faulty', kind='local',
        expect=[],
        faulty_expect=r"exit\(\) called while flexcomm's environment is alive",
        reports="the exiting rank: exit() called while flexcomm's environment is alive; MPI_Abort(1) ends the job"),
    'stall': dict(
        what='rank {f} stalls outside flexcomm for 4x the timeout',
        mpiexec=[], survivors='others', kind='timeout',
        expect=[r'mpi iallreduce on world #7 \(1000 x float, sum\): timed out after \d+ ms \(FLEXCOMM_TIMEOUT\)',
                r'ranks that did not arrive: {f} \(world {f}\)',
                r'rank {f} \(world {f}\): no answer within \d+ ms'],
        reports='timed out in `iallreduce` #7; ranks that did not arrive: {f}'),
    # MPI_Comm_create_group has no nonblocking form: the ranks on time wait inside MPI, where no
    # error can be thrown; the guard thread (backend/mpi/setup.hpp) ends the job once the timeout passes.
    'group-stall': dict(
        what='rank {f} stalls for 4x the timeout before a communicator of every rank is made (MPI_Comm_create_group, '
             'which blocks inside MPI)', min_ranks=2,
        mpiexec=[], survivors='none', kind='abort',
        expect=[],
        faulty_expect=r"flexcomm: rank \d+: world: group 'every rank': MPI_Comm_create_group: timed out after \d+ ms "
                      r"\(FLEXCOMM_TIMEOUT\); stalled at world rank {f} [^\n]*\nflexcomm: rank \d+: ending the job "
                      r"with MPI_Abort\(1\)",
        reports="a rank held there: `world: group 'every rank': MPI_Comm_create_group: timed out after 2000 ms "
                "(FLEXCOMM_TIMEOUT); stalled at world rank {f} (...); not every rank of the group entered it, and MPI "
                "cannot leave the call`, then `ending the job with MPI_Abort(1)`"),
    'stall-engine': dict(
        what='rank {f} stalls; the others wait on the progress engine, as adapters do',
        mpiexec=[], survivors='others', kind='timeout',
        expect=[r'gradient step 3: timed out after \d+ ms \(FLEXCOMM_TIMEOUT\) waiting in the progress engine',
                r"on 'world' .*waiting in #4 iallreduce 1000 x float sum",
                r'ranks that did not arrive: {f} \(world {f}\)'],
        reports='`gradient step 3` timed out in the progress engine; on world #4 iallreduce: ranks that did not arrive: {f}'),
    'stall-skew': dict(
        what='rank {f} stalls; rank 0 enters the step 1.4 grace periods after the others',
        mpiexec=[], survivors='others', kind='timeout', skew=1.4,
        expect=[r'timed out after \d+ ms \(FLEXCOMM_TIMEOUT\)',
                r'ranks that did not arrive: {f} \(world {f}\)\n',
                r'rank {f} \(world {f}\): no answer within \d+ ms'],
        reports='timed out in `iallreduce` #7; ranks that did not arrive: {f} (rank 0, late, still counted as arrived)'),
    'count': dict(
        what='rank {f} reduces 1001 elements, the others 1000',
        mpiexec=[], survivors='all', kind='check',
        expect=[r'ranks disagree: .*{others_ranks}: iallreduce 1000 x float sum.*rank {f}: iallreduce 1001 x float sum'],
        reports='ranks disagree: {others_ranks}: iallreduce 1000 x float sum; rank {f}: iallreduce 1001 x float sum'),
    'dtype': dict(
        what='rank {f} reduces doubles, the others floats',
        mpiexec=[], survivors='all', kind='check',
        expect=[r'ranks disagree: .*{others_ranks}: iallreduce 1000 x float sum.*rank {f}: iallreduce 1000 x double sum'],
        reports='ranks disagree: {others_ranks}: iallreduce 1000 x float sum; rank {f}: ... double sum'),
    'order': dict(
        what='rank {f} posts its two collectives in the other order',
        mpiexec=[], survivors='all', kind='check',
        expect=[r'ranks disagree: .*rank {f}: ibcast 1 x int32 root 0',
                r'{others_ranks}: iallreduce 1000 x float sum'],
        reports='ranks disagree: rank {f}: ibcast 1 x int32 root 0; {others_ranks}: iallreduce 1000 x float sum'),
    'finalize-hang': dict(
        what="rank {f}'s MPI_Finalize never returns (FLEXCOMM_FINALIZE_TIMEOUT=1)",
        mpiexec=[], survivors='all', kind='none', succeeds=True,
        expect=[r'finished every step', r'guards intact'],
        faulty_expect=r'rank {f}: MPI_Finalize has not returned 1\.0 s after every rank passed the shutdown barrier',
        reports="every rank finishes; rank {f}'s guard enters the PMI barrier for it and leaves with status 0",
        openmpi=dict(skip="Open MPI has no PMI-1 socket to stand in on: every rank's guard leaves without "
                          "MPI_Finalize, and Open MPI 4.1.4's mpirun then reports an abnormal termination "
                          "(status 1), or crashes (139) or hangs (3 of 9 runs)")),
    'finalize-hang-status': dict(
        what="as finalize-hang, the program leaving with status 3",
        mpiexec=[], survivors='all', kind='none', succeeds=True, status=3,
        expect=[r'finished every step', r'guards intact'],
        faulty_expect=r'rank {f}: MPI_Finalize has not returned 1\.0 s .*leaving with status 3',
        reports='as finalize-hang; mpiexec exits with the program\'s status 3',
        openmpi=dict(skip="Open MPI has no PMI-1 socket to stand in on: every rank's guard leaves without "
                          "MPI_Finalize, and Open MPI 4.1.4's mpirun then reports an abnormal termination "
                          "(status 1), or crashes (139) or hangs (3 of 9 runs)")),
    'bad-wait': dict(
        what='FLEXCOMM_WAIT=bogus on every rank',
        mpiexec=[], survivors='none', kind='local',
        expect=[], every_rank_expect=r'flexcomm: rank {r}: FLEXCOMM_WAIT: cannot parse .bogus.',
        reports="each rank: `flexcomm: rank N: FLEXCOMM_WAIT: cannot parse 'bogus': expected spin, yield, backoff or "
                "backoff:<max microseconds 1..1000000>`, then MPI_Abort(1) at start"),
    'bad-trace': dict(
        what='FLEXCOMM_TRACE names a directory that cannot be made (/proc/flexcomm-trace)',
        mpiexec=[], survivors='none', kind='local',
        expect=[], every_rank_expect=r"flexcomm: rank {r}: trace: cannot create '/proc/flexcomm-trace'",
        reports="each rank: `flexcomm: rank N: trace: cannot create '/proc/flexcomm-trace': ...`, then MPI_Abort(1) "
                "at start"),
    'typo-setting': dict(
        what='FLEXCOMM_TIMOUT=2 (a misspelling of FLEXCOMM_TIMEOUT) on every rank',
        mpiexec=[], survivors='all', kind='none', succeeds=True,
        expect=[r'finished every step', r'guards intact'],
        faulty_expect=r'flexcomm: rank 0: settings: FLEXCOMM_TIMOUT is not a flexcomm setting and is ignored '
                      r'\(known: FLEXCOMM_WAIT, FLEXCOMM_TIMEOUT, ',
        reports='rank 0: `settings: FLEXCOMM_TIMOUT is not a flexcomm setting and is ignored (known: ...)`; '
                'the job runs and succeeds'),
    'layout': dict(
        what="layout 'producers=1 members=2x2' (5 ranks) on a world of {n}",
        mpiexec=[], survivors='all', kind='local',
        expect=[r"layout: layout 'producers=1 members=2x2' needs 5 ranks, world has {n}"],
        reports="layout 'producers=1 members=2x2' needs 5 ranks, world has {n}"),
    # Adapter faults (tests/fault/adapter_fault.cpp): a shared feed over 'producers=1
    # members=(n-1)x1', and one member's gradient sync over the whole world.
    'feed-none': dict(
        driver='adapter', what='shared feed, no fault (control)', min_ranks=2,
        mpiexec=[], survivors='all', kind='none', succeeds=True, guards=False,
        expect=[r'finished every step'], reports='finished every step'),
    'loader-throws': dict(
        driver='adapter', what='the producer\'s loader throws on step 3', min_ranks=2,
        mpiexec=[], survivors='all', kind='local', guards=False,
        expect=[r'one_to_many: step 3 shard 0: loader on rank 0 failed: decode failed: corrupt JPEG in shard file 17'],
        reports='one_to_many: step 3 shard 0: loader on rank 0 failed: decode failed: ... (the loader\'s text)'),
    'loader-overfills': dict(
        driver='adapter', what='the loader returns 356 bytes for a 256-byte slot on step 3', min_ranks=2,
        mpiexec=[], survivors='all', kind='local', guards=False,
        expect=[r'one_to_many: step 3 shard 0: loader on rank 0 wrote 356 bytes, slot holds 256'],
        reports='one_to_many: step 3 shard 0: loader on rank 0 wrote 356 bytes, slot holds 256'),
    'loader-overwrites': dict(
        driver='adapter', what='the loader writes 8 bytes past its 256-byte slot on step 3', min_ranks=2,
        mpiexec=[], survivors='all', kind='local', guards=False,
        expect=[r'one_to_many: step 3 shard 0: loader on rank 0 wrote past the end of its 256-byte slot'],
        reports='one_to_many: step 3 shard 0: loader on rank 0 wrote past the end of its 256-byte slot'),
    'layout-feed': dict(
        driver='adapter', what="one_to_many built with layout 'producers=1 members={n}x1' on a world of {n}",
        mpiexec=[], survivors='all', kind='local', guards=False,
        expect=[r"one_to_many: layout 'producers=1 members={n}x1' needs {n1} ranks, world has {n}"],
        reports="one_to_many: layout 'producers=1 members={n}x1' needs {n1} ranks, world has {n}"),
    'trainer-stall': dict(
        driver='adapter', what='trainer rank {f} stalls on step 3 for 4x the timeout, holding its batch (as under '
                               'SIGSTOP)', min_ranks=2,
        mpiexec=[], survivors='producer', kind='timeout', guards=False,
        expect=[r'(?m)one_to_many: (credits|send) of step \d+: timed out after \d+ ms \(FLEXCOMM_TIMEOUT\); '
                r'{stalled}not answered by world rank {f}$'],
        reports='the producer: `one_to_many: credits of step N: timed out after 2000 ms (FLEXCOMM_TIMEOUT); not '
                'answered by world rank {f}`'),
    # The adaptive feed (every rank a trainer that makes steps when idle): a maker that stops holding
    # a claim is named by every rank that waits for its piece, and the stream is neither delivered
    # twice nor short: the others stop with the error.
    'claim-stall': dict(
        driver='adapter', what="adaptive feed over 'members={n}x1': rank {f} stalls for 4x the timeout in the "
                               "loader of a step it claimed (as under SIGSTOP)", min_ranks=2,
        mpiexec=[], survivors='others', kind='timeout', guards=False,
        expect=[r'(?m)adaptive: step \d+: timed out after \d+ ms \(FLEXCOMM_TIMEOUT\); {stalled}not answered by world rank {f}$'],
        reports='each other rank: `adaptive: step N: timed out after 2000 ms (FLEXCOMM_TIMEOUT); not answered by world '
                'rank {f}` and `(... it claimed piece 0 of step N and has not made it)`'),
    'claim-dies': dict(
        driver='adapter', what="adaptive feed over 'members={n}x1': rank {f} dies in the loader of a step it "
                               "claimed (mpiexec told to keep the job: {keep_going})", min_ranks=2,
        mpiexec='keep_going', survivors='others', kind='timeout', guards=False,
        expect=[r'(?m)adaptive: step \d+: timed out after \d+ ms \(FLEXCOMM_TIMEOUT\); {stalled}not answered by world rank {f}$'],
        reports='as claim-stall: every other rank names world rank {f}, which claimed the piece'),
    # Across hosts with no producer: the steps of a host whose only trainer stops holding a claim
    # are named, by every rank of the other host that waits for them, by that host's ranks and the
    # couriers the steps go through.
    'claim-stall-hosts': dict(
        driver='adapter', what="adaptive feed over 'members={n}x1' on pretend hosts '{n1h}+1' (no producer: each "
                               "step is made on its home host, couriers carry it): rank {f}, alone on host 1, stalls "
                               "for 4x the timeout in the loader of a step it claimed", min_ranks=2,
        mpiexec=[], survivors='others', kind='timeout', guards=False,
        expect=CLAIM_ACROSS_HOSTS,
        reports='each other rank: `adaptive: step N: timed out after 2000 ms (FLEXCOMM_TIMEOUT); not answered by world '
                "rank {f}` and `(across hosts: host 1 makes step N, and its courier, world rank {f}, sends it to this "
                "host's, world rank 0)`"),
    'claim-dies-hosts': dict(
        driver='adapter', what="the same, but rank {f} dies in that loader (mpiexec told to keep the job: "
                               "{keep_going})", min_ranks=2,
        mpiexec='keep_going', survivors='others', kind='timeout', guards=False,
        expect=CLAIM_ACROSS_HOSTS,
        reports='as claim-stall-hosts: every rank of host 0 names world rank {f}, host 1'),
    # A hand-over (pipeline/handover.hpp): the joining rank stops once the joined member's
    # communicator is made; the member's rank 0, sending it the member's state, names it.
    'handover-stall': dict(
        driver='adapter', what="pipeline over 'members=1,2,...' with hand-overs: member {p}'s rank {f} ends it "
                               "and joins member 0 (rank 0), then stalls for 4x the timeout in its state callback "
                               "(as under SIGSTOP)", min_ranks=4,
        mpiexec=[], survivors='target', kind='timeout', guards=False,
        expect=[r'timed out after \d+ ms \(FLEXCOMM_TIMEOUT\); [^\n]*world rank {f}'],
        reports='rank 0: `mpi iallreduce on \'member 0 from step N\': timed out after 2000 ms (FLEXCOMM_TIMEOUT); '
                'stalled at world rank {f} ...`'),
    'handover-dies': dict(
        driver='adapter', what="the same, but rank {f} dies in its state callback (mpiexec told to keep the job: "
                               "{keep_going})", min_ranks=4,
        mpiexec='keep_going', survivors='target', kind='timeout', guards=False,
        expect=[r'timed out after \d+ ms \(FLEXCOMM_TIMEOUT\); [^\n]*world rank {f}'],
        reports='as handover-stall: rank 0 names world rank {f}'),
    # The same under all_shared: every other rank needs the joining rank's turn in the rounds too.
    **handover_rows('shared', 'all_shared', "(the members take turns loading every step: each waits on rank {f}'s "
                                            "turn too)"),
    # The same under adaptive, on its board: the joining rank holds the step it joins at.
    **handover_rows('adaptive', 'adaptive', "(on its board in shared memory: the joining rank holds the step "
                                            "it joins at)"),
    # The same under one_to_many: a producer (rank 0) feeds the trainers in place; member 0's
    # rank is world rank 1. Five ranks at least: registered at 5 alone.
    **handover_rows('broadcast', 'one_to_many', "(a producer, rank 0, the trainers reading in place; member 0's "
                                                "rank is world rank 1, which names rank {f})", min_ranks=5,
                    survivors='target-after-producer'),
    # The same with a producer per host, on pretend hosts 2+4 (producers 0 and 2): member 0's rank
    # is world rank 1 on the first host, the joining rank {f} on the second. Six ranks: registered
    # at 6 alone.
    **handover_rows('per-host', 'one_to_many', "with a producer per host (pretend hosts 2+4; member 0's rank is "
                                               "world rank 1, the joiner's host is the other)", min_ranks=6,
                    survivors='target-after-producer'),
    # The end of a run with hand-overs: a root that waits for the others' byes past the timeout
    # waits on while they answer (a member that trains longer is no stall); one that died is named.
    'bye-dies': dict(
        driver='adapter', what="pipeline over 'members={n}x1' with hand-overs: member 0 ends at step 1 with nowhere "
                               "to go and waits for the other roots' byes; rank {f} dies at step 3 while it trains "
                               "(mpiexec told to keep the job: {keep_going})", min_ranks=3,
        mpiexec='keep_going', survivors='others', kind='timeout', guards=False,
        expect=[r'timed out after \d+ ms \(FLEXCOMM_TIMEOUT\)[^\n]*world rank {f}'],
        reports="each other rank: `ensemble_pipeline: hand-over: timed out after 2000 ms (FLEXCOMM_TIMEOUT) at the end: "
                "stalled at world rank {f} (...; dead ...); member roots (world ranks {f}) did not say they were done`"),
    'claim-stall-messages': dict(
        driver='adapter', what="adaptive feed over 'producers=1 members={f}x1' with shared memory off (claims go "
                               "to the producer by message): trainer rank {f} stalls for 4x the timeout in the loader "
                               "of a piece it was granted", min_ranks=2,
        mpiexec=[], survivors='producer', kind='timeout', guards=False,
        expect=[r'(?m)(adaptive: piece \d+ of step \d+, claimed by world rank {f}|one_to_many: (credits|send) of step \d+): '
                r'timed out after \d+ ms \(FLEXCOMM_TIMEOUT\); {stalled}not answered by world rank {f}$',
                r'claimed by world rank {f}:|world rank {f} was granted piece'],
        reports='the producer: `adaptive: piece 0 of step N, claimed by world rank {f}: timed out after 2000 ms '
                '(FLEXCOMM_TIMEOUT); not answered by world rank {f}`, or, where rank {f} was granted a piece of a '
                'later step than it sent credits for, `one_to_many: credits of step N: timed out ...; not answered by '
                'world rank {f}` (or, where it is gone, `send of step N`) and `(world rank {f} was granted piece 0 '
                'of step M and has not sent it)`'),
    'claim-dies-messages': dict(
        driver='adapter', what="the same, but rank {f} dies in that loader (mpiexec told to keep the job: "
                               "{keep_going})", min_ranks=2,
        mpiexec='keep_going', survivors='producer', kind='timeout', guards=False,
        expect=[r'(?m)(adaptive: piece \d+ of step \d+, claimed by world rank {f}|one_to_many: (credits|send) of step \d+): '
                r'timed out after \d+ ms \(FLEXCOMM_TIMEOUT\); {stalled}not answered by world rank {f}$',
                r'claimed by world rank {f}:|world rank {f} was granted piece'],
        reports='as claim-stall-messages: the producer names world rank {f}, which holds the grant'),
    'sync-stall': dict(
        driver='adapter', what='trainer rank {f} of a two-rank member (ranks {p} and {f}, one host: shared memory) '
                               'stalls before its gradients of step 3 for 4x the timeout (as under SIGSTOP)',
        min_ranks=2, mpiexec=[], survivors='partner', kind='timeout',
        expect=[SYNC_STALL_PARTNER],
        reports='its partner, world rank {p}: `... shared-memory allreduce ..., rank 0 (world {p}): timed out after '
                '2000 ms waiting for ... not arrived: world rank {f} (rank 1, at step N)`'),
    'sync-stall-unwind': dict(
        driver='adapter', what='as sync-stall, and a collective on a second communicator of the member, driven by the '
                               'progress engine, has not reached MPI when the partner times out (Open MPI holds it '
                               'for its consistency check); that communicator is destroyed as the error unwinds',
        min_ranks=2, mpiexec=[], survivors='partner', kind='timeout',
        expect=[SYNC_STALL_PARTNER],
        reports='its partner as in sync-stall (the side collective went to MPI at once, and waits on the stalled rank)',
        openmpi=dict(
            expect=[SYNC_STALL_PARTNER,
                    r"side collective: .*not posted: communicator 'side' was freed before its turn came"],
            reports="its partner as in sync-stall, and of the side collective: `not posted: communicator 'side' was "
                    "freed before its turn came` (the destructor gave it a grace period, not a second timeout)")),
    'sync-stall-messages': dict(
        driver='adapter', what='the same with FLEXCOMM_SHM=off: the member averages over MPI messages',
        min_ranks=2, mpiexec=[], survivors='partner', kind='timeout',
        expect=[r'timed out after \d+ ms', r'ranks that did not arrive: 1 \(world {f}\)'],
        reports='its partner, world rank {p}: `... timed out after 2000 ms (FLEXCOMM_TIMEOUT) ... ranks that did not '
                'arrive: 1 (world {f})`'),
    'sync-none': dict(
        driver='adapter', what='gradient sync, no fault (control)',
        mpiexec=[], survivors='all', kind='none', succeeds=True,
        expect=[r'finished every step', r'guards intact'], reports='finished every step'),
    'gradient-order': dict(
        driver='adapter', what='rank {f} hands its 4 gradients over in the other order on step 3', min_ranks=2,
        mpiexec=[], survivors='all', kind='check',
        expect=[r"subgroup_allreduce: finish: the member's ranks handed gradients over in different orders"],
        reports="subgroup_allreduce: finish: the member's ranks handed gradients over in different orders or "
                "with different sizes in this step; ... this rank's sequence (index:count) starts 3:48 2:48 ..."),
}


# Device faults (tests/fault/device_fault.cpp): the nccl backend on the device stand-in, each fault
# injected on the last rank through the stand-in's test hooks. A rank whose side failed by itself
# tells the others on the side channel, and their waits end naming it ('peer': within the timeout).
PEER_FAILED = r'the communicator of rank {f} \(world {f}\) failed: nccl iallreduce on world #7 \(1000 x float, sum\): '
DEVICE_FAULTS = {
    'device-none': dict(
        driver='device', what='nccl backend on the device stand-in, no fault (control)',
        mpiexec=[], survivors='all', kind='none', succeeds=True, guards=False,
        expect=[r'finished every step'], reports='finished every step'),
    'nccl-remote-error': dict(
        driver='device', what="rank {f}'s NCCL communicator reports ncclRemoteError before its step-3 allreduce is "
                              "enqueued (the enqueue returns it, as ncclCommEnsureReady does)", min_ranks=2,
        mpiexec=[], survivors='others', kind='peer', guards=False,
        faulty_expect=r'rank {f}: nccl iallreduce on world #7 \(1000 x float, sum\): ncclRemoteError: remote process '
                      r'exited or there was a network error',
        expect=[PEER_FAILED + r'asynchronous NCCL error ncclRemoteError', r'aborted with ncclCommAbort'],
        reports="rank {f}: `nccl iallreduce on world #7 (1000 x float, sum): ncclRemoteError: remote process exited or "
                "there was a network error`; each other rank: `the communicator of rank {f} (world {f}) failed: nccl "
                "iallreduce on world #7 ...: asynchronous NCCL error ncclRemoteError: ...; nccl communicator 'world' "
                "(...) aborted with ncclCommAbort`"),
    'nccl-system-error': dict(
        driver='device', what="rank {f}'s NCCL communicator reports ncclSystemError right after its step-3 allreduce "
                              "is posted (found by ncclCommGetAsyncError while it is in flight, or returned by the "
                              "step-4 enqueue where it had completed)", min_ranks=2,
        mpiexec=[], survivors='others', kind='peer', guards=False,
        faulty_expect=r'rank {f}: nccl (iallreduce|ibcast) on world #[789] \([^)]*\): (asynchronous NCCL error )?'
                      r'ncclSystemError: unhandled system error',
        expect=[r'the communicator of rank {f} \(world {f}\) failed: nccl (iallreduce|ibcast) on world #[789] '
                r'\([^)]*\): (asynchronous NCCL error )?ncclSystemError'],
        reports="rank {f}: `nccl iallreduce on world #7 ...: asynchronous NCCL error ncclSystemError: unhandled "
                "system error; ... aborted with ncclCommAbort` (or its ibcast #8, or #9 at the enqueue); each other rank: `the "
                "communicator of rank {f} (world {f}) failed: nccl iallreduce on world #7 ...: asynchronous NCCL "
                "error ncclSystemError ...`"),
    'cuda-sticky': dict(
        driver='device', what='a kernel of rank {f} faults before step 3 (cudaErrorIllegalAddress): its CUDA context '
                              'is poisoned', min_ranks=2,
        mpiexec=[], survivors='others', kind='peer', guards=False,
        faulty_expect=r'rank {f}: nccl iallreduce on world #7 \(1000 x float, sum\): ncclUnhandledCudaError: .*CUDA: '
                      r'cudaErrorIllegalAddress: an illegal memory access was encountered',
        expect=[PEER_FAILED + r'asynchronous NCCL error ncclUnhandledCudaError: unhandled cuda error; CUDA: '
                              r'cudaErrorIllegalAddress'],
        reports="rank {f}: `nccl iallreduce on world #7 ...: ncclUnhandledCudaError: unhandled cuda error (...); CUDA: "
                "cudaErrorIllegalAddress: an illegal memory access was encountered`; each other rank: `the "
                "communicator of rank {f} (world {f}) failed: ... ncclUnhandledCudaError ...; CUDA: "
                "cudaErrorIllegalAddress ...`"),
    'nccl-init-missing': dict(
        driver='device', what='rank {f} stalls for 4x the timeout instead of making the NCCL communicator',
        min_ranks=2, mpiexec=[], survivors='others', kind='timeout', guards=False,
        expect=[r"(mpi ibcast on world #1 \(129 x uint8, root 0\)|nccl init of 'world' \(rank \d+ of {n}\)): "
                r"(timed out after|did not finish within) \d+ ms \(FLEXCOMM_TIMEOUT\)",
                r'ranks that did not arrive: {f} \(world {f}\)'],
        reports="`mpi ibcast on world #1 (129 x uint8, root 0): timed out after 2000 ms (FLEXCOMM_TIMEOUT)` (the "
                "broadcast of NCCL's unique id; where it completes without rank {f}, `nccl init of 'world' ...: did "
                "not finish within 2000 ms`); ranks that did not arrive: {f}"),
    'nccl-split-missing': dict(
        driver='device', what='rank {f} stalls for 4x the timeout instead of taking part in an ncclCommSplit of '
                              'the world', min_ranks=2,
        mpiexec=[], survivors='others', kind='timeout', guards=False,
        expect=[r"world: nccl split into 'all but the last': did not finish within \d+ ms \(FLEXCOMM_TIMEOUT\); "
                r"the parent and the new communicator aborted with ncclCommAbort",
                r'waiting in #7 ncclCommSplit', r'ranks that did not arrive: {f} \(world {f}\)'],
        reports="`world: nccl split into 'all but the last': did not finish within 2000 ms (FLEXCOMM_TIMEOUT); the "
                "parent and the new communicator aborted with ncclCommAbort`; waiting in #7 ncclCommSplit; ranks "
                "that did not arrive: {f}"),
    'nccl-finalize-stuck': dict(
        driver='device', what='the other ranks enqueue an ncclAllReduce of their own that rank {f} never joins (it '
                              'stalls), then destroy the communicator', min_ranks=2,
        mpiexec=[], survivors='others', kind='timeout', guards=False,
        time_pattern=r'destroyed its communicator after ([0-9.e+-]+) s',
        survivors_expect=r"flexcomm: rank {r}: nccl communicator 'world' \(rank {r} of {n}\): ncclCommFinalize: did "
                         r"not finish within \d+ ms \(FLEXCOMM_TIMEOUT\): work on it waits for a rank that is gone; "
                         r"aborted with ncclCommAbort",
        expect=[r'destroyed its communicator after'],
        reports="each other rank, from the communicator's destructor: `nccl communicator 'world' (rank N of {n}): "
                "ncclCommFinalize: did not finish within 2000 ms (FLEXCOMM_TIMEOUT): work on it waits for a rank "
                "that is gone; aborted with ncclCommAbort`; the job then ends at the shutdown barrier, which names "
                "rank {f}"),
}
FAULTS.update(DEVICE_FAULTS)

# A bad value of each setting (tests/fault/fault.cpp sets it): every rank names the setting and the
# job ends at start (core/setting_values.hpp: check_settings). fault -> (setting, value, what each
# rank reports after `flexcomm: rank N: `).
BAD_SETTINGS = {
    'bad-timeout': ('FLEXCOMM_TIMEOUT', 'abc', "FLEXCOMM_TIMEOUT: cannot parse 'abc': expected seconds, e.g. 300 or 0.5"),
    'bad-timeout-negative': ('FLEXCOMM_TIMEOUT', '-1',
                             "FLEXCOMM_TIMEOUT: cannot parse '-1': expected seconds, e.g. 300 or 0.5"),
    'bad-check': ('FLEXCOMM_CHECK', 'maybe', "FLEXCOMM_CHECK: cannot parse 'maybe': expected 1 (on) or 0 (off)"),
    'bad-finalize-timeout': ('FLEXCOMM_FINALIZE_TIMEOUT', 'soon',
                             "FLEXCOMM_FINALIZE_TIMEOUT: cannot parse 'soon': expected seconds, e.g. 300 or 0.5"),
    'bad-bucket-bytes': ('FLEXCOMM_BUCKET_BYTES', 'lots',
                         "FLEXCOMM_BUCKET_BYTES: cannot parse 'lots': expected a positive byte count, e.g. 26214400, "
                         "64K, 25M, 1G"),
    'bad-segment-bytes': ('FLEXCOMM_SEGMENT_BYTES', '1',
                          "FLEXCOMM_SEGMENT_BYTES: '1' is below the smallest 4096 bytes (4K) a setting may ask for"),
    'bad-hierarchical': ('FLEXCOMM_HIERARCHICAL', 'maybe',
                         "FLEXCOMM_HIERARCHICAL: cannot parse 'maybe': expected auto, on or off"),
    'bad-shm': ('FLEXCOMM_SHM', 'maybe', "FLEXCOMM_SHM: cannot parse 'maybe': expected auto, on or off"),
    'bad-hosts': ('FLEXCOMM_HOSTS', '2+x', "FLEXCOMM_HOSTS: cannot parse '2\\+x': 'x' is not a rank count"),
    'bad-layout': ('FLEXCOMM_LAYOUT', 'members=', "FLEXCOMM_LAYOUT: cannot parse 'members=': member size is empty"),
    'bad-preset': ('FLEXCOMM_PRESET', 'fast',
                   "FLEXCOMM_PRESET: unknown preset 'fast' (known: baseline, single_broadcast, multi_broadcast, "
                   "all_shared, adaptive)"),
    'bad-stage-chunk': ('FLEXCOMM_STAGE_CHUNK', '0',
                        "FLEXCOMM_STAGE_CHUNK: cannot parse '0': expected a chunk size in bytes, 16 .. 2\\^34"),
    'bad-pinned-bytes': ('FLEXCOMM_PINNED_BYTES', '1K',
                         "FLEXCOMM_PINNED_BYTES: '1K' holds less than one chunk (FLEXCOMM_STAGE_CHUNK: 1048576 bytes)"),
    'bad-standin-latency': ('FLEXCOMM_STANDIN_LATENCY', '-5',
                            "FLEXCOMM_STANDIN_LATENCY: cannot parse '-5': expected microseconds, 0 .. 1000000"),
    'bad-standin-devices': ('FLEXCOMM_STANDIN_DEVICES', '0',
                            "FLEXCOMM_STANDIN_DEVICES: cannot parse '0': expected a device count, 1 .. 16"),
    'bad-device': ('FLEXCOMM_DEVICE', 'gpu1', "FLEXCOMM_DEVICE: cannot parse 'gpu1': expected local or a device index"),
}
for name, (setting, value, message) in BAD_SETTINGS.items():
    FAULTS[name] = dict(
        what=f'{setting}={value} on every rank',
        mpiexec=[], survivors='none', kind='local',
        expect=[], every_rank_expect=r'flexcomm: rank {r}: ' + message.replace('(', r'\(').replace(')', r'\)'),
        reports=f"each rank: `flexcomm: rank N: {message.replace(chr(92), '')}...`, then MPI_Abort(1) at start")
# A setting this program cannot use is said once, and the job runs on.
FAULTS['idle-stage-chunk'] = dict(
    what='FLEXCOMM_STAGE_CHUNK=4096 on a program without device backends',
    mpiexec=[], survivors='all', kind='none', succeeds=True,
    expect=[r'finished every step', r'guards intact'],
    faulty_expect=r'flexcomm: rank 0: settings: FLEXCOMM_STAGE_CHUNK does not apply: this program has no device '
                  r'backend \(staged\); ignored',
    reports='rank 0: `settings: FLEXCOMM_STAGE_CHUNK does not apply: this program has no device backend (staged); '
            'ignored`; the job runs and succeeds')


def timeout_seconds():
    return float(os.environ.get('FLEXCOMM_TIMEOUT', '2'))


def grace_seconds(timeout):
    return min(max(timeout / 4, 0.25), 5.0)  # core/watchdog.hpp: watchdog::grace


def bound_seconds(kind, timeout):
    """The longest a surviving rank may take from the faulty step to its error."""
    if kind == 'timeout':
        return timeout + grace_seconds(timeout) * 2.5 + 1.0
    if kind == 'peer':
        return timeout  # a rank whose side failed tells the others at once
    if kind in ('hydra', 'local'):
        return 5.0  # includes mpiexec's start and end, or the steps before the fault
    if kind == 'abort':
        return timeout + grace_seconds(timeout) * 2.5 + 5.0  # a guard's abort, with mpiexec's start and end
    return 2.0


def fields(n, mpi='mpich'):
    f = n - 1
    others = list(range(n - 1))
    others_ranks = ('ranks ' if len(others) > 1 else 'rank ') + ','.join(map(str, others))
    return dict(f=f, p=n - 2, n=n, n1=n + 1, n1h=n - 1, others_ranks=others_ranks, launcher=LAUNCHERS[mpi]['name'],
                keep_going=' '.join(LAUNCHERS[mpi]['keep_going']), stalled=STALLED)


def spec_for(fault, mpi):
    """The fault's expectations under this MPI: its 'openmpi' entry overrides what Open MPI does differently."""
    spec = dict(FAULTS[fault])
    spec.update(spec.pop('openmpi', {}) if mpi == 'openmpi' else {})
    spec.pop('openmpi', None)
    return spec


def run(launch, fault, n):
    """launch: dict(mpi='mpich'|'openmpi', mpiexec=path, flags=[flags before -n], drivers={backend, adapter})."""
    spec = spec_for(fault, launch['mpi'])
    if 'skip' in spec:
        return dict(fault=fault, n=n, skipped=spec['skip'], problems=[], output='')
    if n < spec.get('min_ranks', 1):
        return dict(fault=fault, n=n, skipped=f"needs {spec['min_ranks']} ranks", problems=[], output='')
    driver = launch['drivers'][spec.get('driver', 'backend')]
    timeout = timeout_seconds()
    extra = LAUNCHERS[launch['mpi']][spec['mpiexec']] if isinstance(spec['mpiexec'], str) else spec['mpiexec']
    cmd = ([launch['mpiexec']] + launch['flags'] + extra +
           ['-n', str(n), driver, 'exit' if fault == 'exit-cleanup' else fault])
    start = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout * 6 + 30)
    wall = time.monotonic() - start
    out = proc.stdout
    by_rank = {}
    for line in out.splitlines():
        m = re.match(r'\[rank (\d+)\] (.*)', line)
        if m:
            by_rank.setdefault(int(m.group(1)), []).append(m.group(2))
    problems = []
    if spec.get('succeeds'):
        if proc.returncode != spec.get('status', 0):
            problems.append(f"mpiexec exited with status {proc.returncode}, expected {spec.get('status', 0)}")
    elif proc.returncode == 0:
        problems.append('mpiexec exited with status 0')
    if 'GUARD BROKEN' in out:
        problems.append('a rank wrote past a buffer')
    if re.search(r'Segmentation fault|\*\*\* Process received signal \*\*\*', out):
        problems.append('a rank crashed')
    f = fields(n, launch['mpi'])
    survivors = {'all': list(range(n)), 'others': list(range(n - 1)), 'producer': [0], 'none': [],
                 'faulty': [], 'partner': [n - 2], 'target': [0], 'target-after-producer': [1]}[spec['survivors']]
    for r in range(n) if 'every_rank_expect' in spec else []:
        if not re.search(spec['every_rank_expect'].format(r=r, **f), out):
            problems.append(f"rank {r}: no match for /{spec['every_rank_expect'].format(r=r, **f)}/")
    if 'faulty_expect' in spec and not re.search(spec['faulty_expect'].format(**f), out):
        problems.append(f"no match for /{spec['faulty_expect'].format(**f)}/")
    for r in survivors if 'survivors_expect' in spec else []:
        if not re.search(spec['survivors_expect'].format(r=r, **f), out):
            problems.append(f"rank {r}: no match for /{spec['survivors_expect'].format(r=r, **f)}/")
    times = []
    for r in survivors:
        text = '\n'.join(by_rank.get(r, []))
        for pattern in spec['expect']:
            if not re.search(pattern.format(**f), text):
                problems.append(f'rank {r}: no match for /{pattern.format(**f)}/')
        m = re.search(spec.get('time_pattern', r'caught after ([0-9.e+-]+) s'), text)
        if spec.get('succeeds'):
            continue
        if not m:
            problems.append(f'rank {r}: reported no error')
            continue
        times.append(float(m.group(1)))
        if spec.get('guards', True) and 'guards intact' not in text:
            problems.append(f'rank {r}: did not check its guard words')
    bound = bound_seconds(spec['kind'], timeout)
    if spec['kind'] in ('hydra', 'local', 'abort') and not times:
        times = [wall]  # no rank survives to report: the job's end is the time to error
    if times and max(times) > bound:
        problems.append(f'slowest rank took {max(times):.2f} s to its error, bound {bound:.2f} s')
    if wall > timeout * 2 + grace_seconds(timeout) * 4 + 10:
        problems.append(f'mpiexec took {wall:.2f} s')
    return dict(fault=fault, n=n, rc=proc.returncode, wall=wall, time_to_error=max(times) if times else None,
                bound=bound, problems=problems, output=out)


def table(launches, n, only=None):
    """The first launch fills the main columns; each further one (another MPI) adds a column with its
    time to error, wall time and exit status, and its report where that differs. `only`: that
    fault's row alone."""
    f = fields(n, launches[0]['mpi'])
    names = {'mpich': 'MPICH', 'openmpi': 'Open MPI'}
    print('| fault | injected | what each surviving rank reports | time to error (slowest rank) | '
          'mpiexec wall time | exit status |' + ''.join(f" {names[l['mpi']]}: time to error, wall time, exit status |"
                                                      for l in launches[1:]))
    print('| --- | --- | --- | --- | --- | --- |' + ' --- |' * (len(launches) - 1))
    ok = True
    for fault, spec in FAULTS.items():
        if n < spec.get('min_ranks', 1) or (only and fault != only):
            continue
        cells = []
        for launch in launches:
            r = run(launch, fault, n)
            if 'skipped' in r:
                cells.append(f"not run: {r['skipped']}")
                continue
            ok = ok and not r['problems']
            tte = f"{r['time_to_error']:.3f} s" if r['time_to_error'] is not None else '-'
            status = 'checked' if not r['problems'] else 'FAILED: ' + '; '.join(r['problems'])
            if not cells:
                cells = [spec['what'].format(**f), spec['reports'].format(**f), tte, f"{r['wall']:.2f} s",
                         f"{r['rc']} ({status})"]
                continue
            other, g = spec_for(fault, launch['mpi']), fields(n, launch['mpi'])
            differs = other['reports'].format(**g) != spec['reports'].format(**f)
            note = ('; ' + other['reports'].format(**g)) if differs else ''
            cells.append(f"{tte}, {r['wall']:.2f} s, {r['rc']} ({status}){note}")
        print(f"| `{fault}` | " + ' | '.join(cells) + ' |')
    return 0 if ok else 1


def check_doc(path):
    text = open(path).read()
    missing = [f for f in FAULTS if f'| `{f}` |' not in text]
    if missing:
        print(f'{path} lacks rows for: {", ".join(missing)}')
        return 1
    print(f'{path} documents all {len(FAULTS)} faults')
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--mpiexec', default='mpiexec')
    ap.add_argument('--mpi', choices=sorted(LAUNCHERS), default='mpich', help='the implementation behind --mpiexec')
    ap.add_argument('--mpiexec-flags', default='', help='flags every mpiexec command takes (one string)')
    ap.add_argument('--also', nargs=4, action='append', default=[], metavar=('MPI', 'MPIEXEC', 'FLAGS', 'BUILD'),
                    help='--table: a column for another MPI, its drivers in BUILD/tests '
                         '(e.g. openmpi mpiexec.openmpi "--oversubscribe" build-openmpi)')
    ap.add_argument('--driver', help='tests/fault/fault.cpp built')
    ap.add_argument('--adapter-driver', help='tests/fault/adapter_fault.cpp built')
    ap.add_argument('--device-driver', help='tests/fault/device_fault.cpp built (on the device stand-in)')
    ap.add_argument('--fault', choices=sorted(FAULTS))
    ap.add_argument('-n', type=int, default=4)
    ap.add_argument('--table', action='store_true')
    ap.add_argument('--check-doc')
    a = ap.parse_args()
    if a.check_doc:
        return check_doc(a.check_doc)
    launches = [dict(mpi=a.mpi, mpiexec=a.mpiexec, flags=shlex.split(a.mpiexec_flags),
                     drivers={'backend': a.driver, 'adapter': a.adapter_driver, 'device': a.device_driver})]
    launches += [dict(mpi=m, mpiexec=x, flags=shlex.split(fl),
                      drivers={'backend': os.path.join(b, 'tests', 'fault_driver'),
                               'adapter': os.path.join(b, 'tests', 'adapter_fault_driver'),
                               'device': os.path.join(b, 'tests', 'device_fault_driver')})
                 for m, x, fl, b in a.also]
    if a.table:
        return table(launches, a.n, a.fault)
    r = run(launches[0], a.fault, a.n)
    if 'skipped' in r:
        print(f"fault {a.fault} np{a.n}: skipped under {a.mpi}: {r['skipped']}")
        return 77
    sys.stdout.write(r['output'])
    tte = f"{r['time_to_error']:.3f} s" if r['time_to_error'] is not None else 'n/a'
    print(f"fault {a.fault} np{a.n}: exit status {r['rc']}, time to error {tte} (bound {r['bound']:.2f} s), "
          f"mpiexec {r['wall']:.2f} s")
    for p in r['problems']:
        print('PROBLEM:', p)
    return 1 if r['problems'] else 0


if __name__ == '__main__':
    sys.exit(main())
