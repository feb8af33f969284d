"""The ground floor for running on a cluster: Ray set-up (`ray_ops`: one `ray.init` policy,
placement groups and bundles, spawning an actor in a bundle, gathering with a deadline, naming
a dead actor) and free ports (`ports`). Imports only ray and the standard library; the actor
group (trainer/actor/group.py), the rollout dispatcher (rollout/dispatch.py) and colocation
(rollout/colocate.py) are built on it and pass it numbers, never the experiment config."""
