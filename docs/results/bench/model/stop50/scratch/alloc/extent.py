import sys
ev=[l.split() for l in open(sys.argv[1])]
live={}; hi=0; cur=-1; rows=[]
lo=None
for e in ev:
    if e[0]=="M":
        cur=int(e[2])
        continue
    a,s=int(e[2],16),int(e[3])
    if e[0]=="A":
        live[a]=s
        if a<0x7f0000000000:
            if lo is None or a<lo: lo=a
    else: live.pop(a,None)
# second pass with base
base=lo; live={}; hi=base; rows=[]
for e in ev:
    if e[0]=="M":
        cur=int(e[2])
        if cur%10==3 or cur==9999:
            mh={a:s for a,s in live.items() if a<0x7f0000000000}
            ext=max((a+s for a,s in mh.items()), default=base)
            rows.append((cur, round((hi-base)/2**20,1), round(sum(mh.values())/2**20,1), round((ext-base)/2**20,1)))
        continue
    a,s=int(e[2],16),int(e[3])
    if e[0]=="A":
        live[a]=s
        if a<0x7f0000000000: hi=max(hi,a+s)
    else: live.pop(a,None)
print("layer  max_extent_seen  live_big  live_extent")
for r in rows: print(*r)
