#!/usr/bin/env bash
# DARO in verl 0.9.1, one node of 8 GPUs: the DARO paper's runs as docs/gpu.md runs them with daro.py
# (Qwen2.5-Math-7B on the 45k OpenR1-Math subset, K = 8, 128 prompts and 2 updates of 64 per step, 1,096 + 3,000
# tokens, no overlong shaping, no dynamic sampling, weights' lr 1e-3). Every override below is a key of verl's
# config: tests/test_verl.py composes them on verl's ppo_trainer config. Needs verl's own install
# (pip install -r requirements/verl.txt) and verl_da3po_daro.py in $DROPIN_DIR (by default this file's folder).
#   algorithm.adv_estimator=daro                 GRPO's advantages, each row's bin (#correct of its group, correct =
#                                                score > -0.5) for the loss
#   actor.policy_loss.loss_mode=daro             sum_mu w_mu L_mu, L_mu a token mean within bin mu over each update;
#                                                the weights step after each update and are saved with the actor's
#                                                checkpoint (daro_weights.pt); logged as actor/daro/w_0.125, ...
#   actor.clip_ratio_c=1e9                       dual clip off, as in the paper (verl's default 3.0; verl needs
#                                                c > 1 and caps the ratio at e^20 < 1e9)
#   actor.optim: lr 1e-6, no warm-up, weight decay 0.1, grad_clip 1.0; no KL; reward manager `dapo` without
#   shaping: +1/-1 from math_dapo's scorer (the dataset's data_source)
set -euo pipefail
DROPIN_DIR=${DROPIN_DIR:-$(cd "$(dirname "$0")" && pwd)}
MODEL=${MODEL:-Qwen/Qwen2.5-Math-7B}
TRAIN=${TRAIN:-openr1_45k.parquet}
VAL=${VAL:-math500.parquet}
OUT=${OUT:-runs/verl_daro}
export VERL_USE_EXTERNAL_MODULES=verl_da3po_daro  # imported wherever verl is: the trainer and every worker
export PYTHONPATH=$DROPIN_DIR${PYTHONPATH:+:$PYTHONPATH}
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=daro \
    algorithm.use_kl_in_reward=false \
    algorithm.filter_groups.enable=false \
    data.train_files=$TRAIN \
    data.val_files=$VAL \
    data.prompt_key=prompt \
    data.train_batch_size=128 \
    data.max_prompt_length=1096 \
    data.max_response_length=3000 \
    actor_rollout_ref.model.path=$MODEL \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.actor.policy_loss.loss_mode=daro \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=1e9 \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_epochs=1 \
    actor_rollout_ref.actor.use_dynamic_bsz=true \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
    actor_rollout_ref.rollout.val_kwargs.n=8 \
    actor_rollout_ref.rollout.val_kwargs.do_sample=true \
    reward.reward_manager.name=dapo \
    trainer.total_training_steps=300 \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=10 \
    trainer.test_freq=20 \
    trainer.resume_mode=auto \
    trainer.project_name=daro \
    trainer.experiment_name=verl_daro \
    trainer.default_local_dir=$OUT \
    "$@"
