# train a small character-level model on the poems dataset

out_dir = 'out-poems-char'
eval_interval = 500
eval_iters = 100
log_interval = 10

always_save_checkpoint = False

dataset = 'poems_char'
gradient_accumulation_steps = 2
batch_size = 48
block_size = 384 # context of up to 384 previous characters

n_layer = 8
n_head = 8
n_embd = 512
dropout = 0.1

learning_rate = 8e-4
max_iters = 6000
lr_decay_iters = 6000
min_lr = 8e-5
beta2 = 0.99

warmup_iters = 200
