"""One modular-arithmetic experiment: python exp.py NAME json-overrides"""
import json, sys, time
import torch
torch.set_num_threads(1)
from extrapolab.regular.train import RegularRunConfig, run
name, over = sys.argv[1], json.loads(sys.argv[2])
base = dict(task="modular_arithmetic", model="regulargpt", model_options={"C": 2}, seed=0, steps=8000,
            lr=1e-3, eval_every=250, test_stride=10, test_samples=64)
base.update(over)
cfg = RegularRunConfig.from_dict(base)
t0 = time.time()
res = run(cfg, f"/tmp/ma/{name}_run", progress=False)  # run folder kept for eval/erf
res.pop("model")
out = {"name": name, "overrides": over, "wall": time.time() - t0,
       **{k: res[k] for k in ("steps_run", "best_step", "train_seconds", "eval_seconds", "mean_test", "min_test",
                              "mean_train_lengths", "acc_at_train_max", "num_params")},
       "per_train_length": res["per_train_length"], "history": res["history"]}
json.dump(out, open(f"/tmp/ma/{name}.json", "w"), indent=1)
print(name, over, "wall %.0f s" % out["wall"], "steps", out["steps_run"], "best", out["best_step"],
      "train-len acc %.3f" % out["mean_train_lengths"], "acc@39 %.3f" % out["acc_at_train_max"],
      "test %.3f" % out["mean_test"], "params", out["num_params"])
for h in res["history"]:
    print("  step %5d loss %.3f in %.3f val %.3f  %.0fs" % (h["step"], h["loss"], h["acc_train_len"], h["acc_val"], h["seconds"]))
