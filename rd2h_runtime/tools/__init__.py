"""Tools around the runtime: the ``rd2h`` command and what its subcommands and the tests use.

``cli`` (the ``rd2h`` command), ``demo`` (``rd2h demo``), ``check_read`` (``rd2h
check-read``), ``bench`` (``rd2h bench``), ``timeline`` and ``trace_check`` (``rd2h
trace``), and the synthetic engines (``engines``, ``synthetic``) that the demo, the
end-to-end tests and the benchmarks drive. The runtime proper (workers, control plane,
transfer backends, planning, proxy, trace writer) never imports this package.
"""
