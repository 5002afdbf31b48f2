"""The shared base every experiment is composed from. Hyperparameters live only in get_config files."""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.method = "dp"                # dp | diloco | streaming
    c.scale = "toy"                # a name from `diloco sizes`
    c.data = "stdlib"              # stdlib | c4 | c4:<dir> | dolma | dolma:<glob> | jsonl:<glob> | text:<glob> | tokens:<store>
    c.data_dir = ""                # TFDS data_dir for c4/dolma
    c.vocab = "byte"               # byte | sentencepiece:<path>
    c.seq_len = 128
    c.batch_size = 16              # global, in sequences (each replica gets batch_size / replicas)
    c.accum_steps = 1              # gradient accumulation: each inner step averages the gradients of this many
                                   # microbatches of its batch, run one after another (less activation memory)
    c.steps = 300
    c.seed = 0
    c.log_every = 10
    c.eval_every = 100
    c.eval_batches = 8
    # θᵍ evaluated with the fragments still in flight applied (outer step + merge), as at the next
    # sync boundary: 'final' (the summary's final_eval_loss) or 'every' (every eval row too)
    # where a send's exchange runs: "blocking" (its own program), "in_step" (inside the next inner
    # step's program, so it overlaps that step's compute on TPU/GPU; needs tau ≥ 1), "auto" (in_step on
    # TPU/GPU when tau ≥ 1, else blocking; a comm device — diloco launch --comm_device — wins on CPU)
    c.exchange = "auto"
    c.eval_drain = "final"
    c.checkpoint_every = 100
    c.keep_checkpoints = 2
    # "" (one SPMD job) or grpc://HOST:PORT: this process is independent learner `learner` (0 … replicas-1) of
    # a `diloco syncer` run (docs/distributed.md §11). Neither key is part of the run's fingerprint.
    c.sync = ""
    c.learner = -1

    # DiLoCo family (ignored by dp except `replicas` and `dp_grad_dtype` for bytes accounting).
    c.replicas = 2                 # M
    c.H = 30                       # inner steps between two syncs of one fragment
    c.tau = 0                      # overlap: apply τ inner steps after send (0 ≤ τ < H)
    c.replica_tau = ""             # heterogeneous workers: "τ_1,τ_2,…" (one per replica) overrides tau
    c.alpha = 0.0                  # merge: θ_m ← α·θ_m + (1−α)·θ_global
    c.fragments = 0                # explicit P (0: use layers_per_fragment)
    c.layers_per_fragment = 0      # blocks per fragment (paper: 3); 0 with fragments=0 means P = 1
    c.pattern = "strided"          # strided | sequential
    c.embed_fragment = "first"     # where embeddings + final norm sync: first | last | own
    c.codec = "none"               # FORMATS (outer/codecs.py): none | bf16 | fp8_e4m3 | fp8_e5m2 | e3m0 | int2 | topk | dropout | dare
    c.codec_block_size = 256
    c.codec_rounding = "nearest"   # nearest | stochastic
    c.codec_keep_fraction = 1.0    # for topk / dropout / dare
    c.dp_grad_dtype = "bfloat16"   # what DP is counted as sending each step
    c.freeze_non_syncing = False   # FedPart-style baseline: only the fragment next to sync trains
    # [EU] eager updates: off | naive | swap | mix; the exchange of a fragment's round is applied
    # eager_rounds rounds later (needs tau = 0: the delay is eager_rounds·H; docs/architecture.md)
    c.eager = "off"
    c.eager_rounds = 1
    c.error_feedback = False       # each replica re-sends what its codec dropped (a residual per fragment)

    # the outer optimizer by name: nesterov (the paper's) | sgd | adam | adamw | muon (diloco/outer/sync.py
    # OUTER_OPTIMIZERS); momentum is Adam's b1; b2, eps, weight_decay are Adam's / AdamW's
    c.outer = ml_collections.ConfigDict(dict(name="nesterov", lr=0.4, momentum=0.9, b2=0.999, eps=1e-8,
                                             weight_decay=1e-4))
    c.optimizer = ml_collections.ConfigDict(dict(
        lr=3e-3, warmup_steps=30, min_lr_ratio=0.05, weight_decay=0.1, b1=0.9, b2=0.99, clip_norm=1.0))
    # remat_policy: none | full | save_dots | auto; attention: xla | dot_product | cudnn | splash | auto (splash
    # on TPU, cuDNN's fused kernel on GPU where dtype and head size allow, else xla); scan: true | false | auto
    # (nn.scan at the paper's scales only). remat=True is "full". Every auto is resolved once, from the config
    # and the devices (diloco/resolve.py), and recorded in summary.json["resolved"]. matmul_precision: auto (JAX's:
    # TF32 float32 matmuls on an NVIDIA GPU, full float32 on CPU) | default | high | highest (parity with CPU on GPU).
    c.model = ml_collections.ConfigDict(dict(dtype="float32", remat=False, scan="auto", z_loss=1e-4,
                                             remat_policy="auto", attention="auto", matmul_precision="auto"))
    # replica_axis 0: auto (M if the devices allow, else 1). Inside a replica the devices are data × fsdp
    # (one of them -1: the remaining devices); fsdp > 1 shards params, AdamW moments and the outer state.
    # rules: logical axis name → mesh axes inside a replica ("name=axis[+axis],…"; diloco/axes.py mesh_rules):
    # parameters/AdamW moments/θᵍ and the activations are laid out by them (docs/distributed.md).
    # fsdp 0 = auto: 1 at the toy scales, every device of a replica at the paper's scales (resolve.mesh_shape).
    # tensor: chips of a replica splitting heads, MLP and vocabulary (Megatron-style; 0 or `auto`: the smallest
    # that fits, resolve.tensor_size); data × fsdp × tensor = the devices of a replica.
    c.mesh = ml_collections.ConfigDict(dict(replica_axis=0, data=-1, fsdp=0, tensor=1,
                                            rules="batch=data+fsdp,embed=fsdp"))
    c.downstream = ml_collections.ConfigDict(dict(tasks="", every=0, limit=0, data_dir=""))
    c.faults = ml_collections.ConfigDict(dict(
        miss_sync_replica=-1, miss_sync_step=0,           # replica m skips the send at that step
        restart_replica=-1, restart_step=0,               # replica m restarts from the outer params
        nan_policy="stop",                                # stop | skip (skip the bad batch)
        nan_step=0, nan_replica=0,                        # inject a non-finite value at that step (0: off)
        nan_target="loss", nan_value="nan"))              # loss | outer (replica params before a send); nan | inf
    return c
