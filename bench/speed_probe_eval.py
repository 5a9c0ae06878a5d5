#!/usr/bin/env python3
"""Tried and not kept (docs/BENCHMARKS.md, "Thirteenth session"): scale each repetition's
predictions in a stored `tandem bench --calibrate` CSV by the single worker's measured over
predicted step in that repetition, and count the rows within 20 % before and after.
usage: bench/speed_probe_eval.py DIR...   (e.g. bench/protocol-runs/run3* bench/protocol-runs/run40)
"""
import csv, glob, statistics as st, sys
tot=[0,0,0]
for d in sys.argv[1:]:
  for f in glob.glob(d+'/bench_*.csv'):
    rows=list(csv.DictReader(open(f)))
    single=[r for r in rows if r['strategy']=='single'][0]
    if not single.get('step_ms_per_rep'): continue
    sm=[float(x) for x in single['step_ms_per_rep'].split(';')]
    sp=[float(x) for x in single['predicted_ms_per_rep'].split(';') if x]
    if len(sp)!=len(sm): continue
    ratio=[m/p for m,p in zip(sm,sp)]
    ok0=ok1=n=0
    for r in rows:
      if r['strategy']=='single' or not r['predicted_ms_per_rep']: continue
      m=[float(x) for x in r['step_ms_per_rep'].split(';')]
      p=[float(x) for x in r['predicted_ms_per_rep'].split(';')]
      if len(p)!=len(m): continue
      e0=(st.median(p)-st.median(m))/st.median(m)
      pc=[pp*rr for pp,rr in zip(p,ratio)]
      e1=(st.median(pc)-st.median(m))/st.median(m)
      n+=1; ok0+=abs(e0)<=0.2; ok1+=abs(e1)<=0.2
    print(d.split('/')[-1], f.split('/')[-1], 'ratios', [round(x,2) for x in ratio], 'within 20%% %d -> %d of %d' % (ok0, ok1, n))
    tot[0]+=ok0; tot[1]+=ok1; tot[2]+=n
print(tot)
