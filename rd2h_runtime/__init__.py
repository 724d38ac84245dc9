"""rd2h runtime: binds the sans-IO protocol to sockets, threads and transfer backends."""
