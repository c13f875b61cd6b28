"""Multi-rank plumbing, framework-free: what generate() needs to know about a model split across
ranks (``model_group``), joining the launcher's job and sharing host values (``launcher``), and
the even split of heads / vocabulary a tensor-parallel rank holds (``tp_plan``)."""
