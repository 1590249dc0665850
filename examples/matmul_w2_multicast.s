; int8 x ternary matmul y = x @ w on dlegion-tiny, split over both Legions by output column.
; Legion 0 multicasts the activations to both Legions with one DRAM read; each Legion loads
; its own half of the packed ternary weights and runs a w2 pass set split over its cores'
; K-slices (summed by the parallel accumulators). A `wait=` makes an instruction start only
; once the named queue has completed that many instructions.
.arch dlegion-tiny
.data "matmul_w2_multicast.s.data"
.tensor x i8[32,64] input "x"
.tensor w w2[64,32] const 0
.tensor y i32[32,32] output "y"

dma.ld L0 {0-1} act[0,64,1] @x[0,64] rows=32 cols=64
dma.ld L0 {0} wgt[0,4,1] @w[0,8] rows=64 cols=4
dma.ld L1 {1} wgt[0,4,1] @w[4,8] rows=64 cols=4

mm L0 acc[0,16] act[0,64] wgt[0,4] M=32 K=64 N=16 mode=w2 split=k accumulate=set mask=none wait=L0.dma>=2
wait L1 mat L0.dma>=1
mm L1 acc[0,16] act[0,64] wgt[0,4] M=32 K=64 N=16 mode=w2 split=k accumulate=set mask=none wait=L1.dma>=1

dma.st L0 @y[0,32] acc[0,16,1] rows=32 cols=16 wait=L0.mat>=1
dma.st L1 @y[16,32] acc[0,16,1] rows=32 cols=16 wait=L1.mat>=2
