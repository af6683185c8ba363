import json, sys
rows=[l.split() for l in open('disk_samples.log')]
S=[(float(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in rows]
ends=[(float(r[0]), json.loads(' '.join(open('demo_3b.log').read().split('\n')[0:0]) or '{}')) for r in rows if len(r)>5]
log=[json.loads(l) for l in open('demo_3b.log') if l.startswith('{"step"')]
def at(t):
    return min(S, key=lambda s: abs(s[0]-t))
for (tend, _), row in zip(ends, [r for r in log if r['step']>=2]):
    t2=tend; t1=t2-row['opt_step_s']; t0=t1-row['fwd_bwd_s']
    for name,a,b in (('fwd+bwd',t0,t1),('optimizer',t1,t2),('step',t0,t2)):
        sa, sb = at(a), at(b)
        dt=sb[0]-sa[0]
        print(f"step {row['step']} {name:9s} {dt:6.0f} s  busy {(sb[1]-sa[1])/1000/dt:5.0%}  read {(sb[2]-sa[2])*512/1e9/dt:5.2f} GB/s  write {(sb[3]-sa[3])*512/1e9/dt:5.2f} GB/s  (sample gap at start {abs(sa[0]-a):.0f} s)")
