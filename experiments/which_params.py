"""[SD] Table 3: which parameters to evaluate (first replica, replica average, outer θ^g).

  experiments/which_params.py:<scale>     (500M presumed in the paper; tiny/toy on CPU)
Training is the paper's final method; `diloco tables` evaluates the three parameter sets from the
run's last checkpoint (the trainer itself always evaluates θ^g).
"""
from experiments import common


def get_config(arg: str = "toy"):
    a = common.parse(arg, "which_params", ("scale",))
    c = common.new()
    common.sized(c, a["scale"])
    return common.method(c, "streaming_ovl_fp4_h30")
