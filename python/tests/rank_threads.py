"""One thread per rank for the tests that run W ranks in one process (test_select, test_torch,
test_gpu)."""

import threading


def run_rank_threads(W, fn, group=None, timeout=None):
    """fn(r) for r in 0..W-1, each on its own thread; the first rank's exception is re-raised.
    With a group (anything with abort()), a failing rank aborts it, and with a timeout the ranks
    that have not finished by then are aborted too, so that a broken exchange fails the test
    instead of hanging it."""
    errors = []

    def body(r):
        try:
            fn(r)
        except BaseException as e:  # noqa: B902  (reported below)
            errors.append(e)
            if group is not None:
                group.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        if group is not None:
            group.abort()
        for t in threads:
            t.join()
        raise AssertionError("the ranks did not finish")
    if errors:
        raise errors[0]
