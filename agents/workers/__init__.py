"""An agent's worker side: the processes that run a job's ranks, and the files and environment
through which an agent talks to them.

- :mod:`.procs`: worker processes (start, output, reports, signals, reaping), no ranks or rounds;
- :mod:`.template`: the spare template that forks warm spares (both ends of its wire);
- :mod:`.pool`: warm spares handed out as a round's ranks; exits and stopping;
- :mod:`.warmup`: what spares import and how long they warm on idle CPU (pure);
- :mod:`.early`: what ``ftrt launch`` starts before the agent's heavier imports;
- :mod:`.env`: torchrun's environment plus ftrt's for one worker (pure);
- :mod:`.fence`: the lease deadline a worker stops itself at;
- :mod:`.boundary`: when and how long an agent waits for a round to end at a step boundary;
- :mod:`.keep`: which workers take the next round in place (pure);
- :mod:`.hangs`: which workers are silent past the hang timeout (pure);
- :mod:`._bootstrap`: the entry point of every worker process.
"""
