"""Stop 54: why the demo's pancake continuation differs: the recipe's logits against the original's over the
original's greedy continuation (teacher-forced without a cache, step by step through a cache, and as generation
runs it: the prompt, then steps), and the positions where the greedy token differs with both models' margins.

    python docs/results/bench/model/stop54/scratch/cont.py
"""
import torch, sys
from oal.models import load_model, load_tokenizer, KernelCache
from oal.conversion.generate import generate_text
torch.set_num_threads(2)
o = load_model("smollm2-135m").eval(); c = load_model("docs/results/conversion/model").eval()
tok = load_tokenizer("smollm2-135m")
p = "Here is a short recipe for pancakes:"
for name, m in (("orig", o), ("conv", c)):
    print(name, repr(generate_text(m, tok, p, max_new_tokens=40).text))
# teacher-forced: original's continuation, compare logits no cache
text = p + generate_text(o, tok, p, max_new_tokens=40).text
ids = tok(text, return_tensors="pt").input_ids
print("ids", ids.shape)
with torch.no_grad():
    lo = o(ids).logits; lc = c(ids, use_cache=False).logits
    print("no-cache max|diff| per pos", (lo - lc).abs().amax(-1)[0].tolist()[:60])
    print("argmax agree", (lo.argmax(-1) == lc.argmax(-1)).float().mean().item())
    # cached step by step
    cache = KernelCache(c); outs = []
    for t in range(ids.shape[1]):
        outs.append(c(ids[:, t:t+1], cache=cache).logits)
    lcc = torch.cat(outs, 1)
    print("stepwise vs nocache conv", (lcc - lc).abs().amax(-1)[0].tolist()[:60])
    pos = (lo.argmax(-1) != lc.argmax(-1))[0].nonzero().flatten().tolist()
    for q in pos:
        top = lo[0, q].topk(2)
        print("flip at", q, "orig top2", [tok.decode([i]) for i in top.indices.tolist()], (top.values[0]-top.values[1]).item(),
              "conv picks", tok.decode([lc[0, q].argmax().item()]), "margin conv", (lc[0,q].topk(2).values[0]-lc[0,q].topk(2).values[1]).item())
    pos = (lo.argmax(-1) != lcc.argmax(-1))[0].nonzero().flatten().tolist()
    for q in pos:
        top = lo[0, q].topk(2)
        print("stepflip at", q, tok.decode(ids[0, max(0,q-5):q+1]), "| orig top2", [tok.decode([i]) for i in top.indices.tolist()], (top.values[0]-top.values[1]).item(),
              "conv picks", tok.decode([lcc[0, q].argmax().item()]), lcc[0,q].topk(3))
    # generate path: prompt prefill, then steps
    pid = tok(p, return_tensors="pt").input_ids
    print("prompt ids", pid.shape, "text ids", ids[0,:pid.shape[1]].tolist() == pid[0].tolist())
    cache = KernelCache(c); lg = c(pid, cache=cache).logits
    n0 = pid.shape[1]
    gl = [lg]
    for t in range(n0, ids.shape[1]):
        gl.append(c(ids[:, t:t+1], cache=cache).logits)
    lg = torch.cat(gl, 1)
    print("prefill+steps vs nocache", (lg - lc).abs().amax(-1)[0].tolist())
    pos = (lo.argmax(-1) != lg.argmax(-1))[0].nonzero().flatten().tolist()
    for q in pos:
        top = lo[0, q].topk(2)
        print("genflip at", q, repr(tok.decode(ids[0, max(0,q-5):q+1])), "| orig top2", [tok.decode([i]) for i in top.indices.tolist()], (top.values[0]-top.values[1]).item(),
              "conv", [tok.decode([i]) for i in lg[0, q].topk(2).indices.tolist()], lg[0,q].topk(2).values.tolist())
