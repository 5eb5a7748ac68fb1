"""The page codec: pure computation, no I/O, no ray, no zmq.

``kernels`` picks the kernel backend (the compiled ``_kernels`` extension built from cython_ext/, or
``reference``, the numpy twin that is the numerical contract); ``pages`` encodes and decodes one page; ``assemble``
rebuilds a token range from pages; ``batch`` is the store's path that seals and reads whole rows of pages per
call into C. Users import the public codec as :mod:`kvd.pages` and :mod:`kvd.kernels`.
"""
