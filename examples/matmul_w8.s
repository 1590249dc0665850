; int8 x int8 matmul y = x @ w on one Legion of dlegion-tiny, K split in two accumulating
; instructions to show accumulate=add.
.arch dlegion-tiny
.data "matmul_w8.s.data"
.tensor x i8[16,32] input "x"
.tensor w i8[32,24] const 0
.tensor y i32[16,24] output "y"

dma.ld L0 {0} act[0,32,1] @x[0,32] rows=16 cols=32
dma.ld L0 {0} wgt[0,24,1] @w[0,24] rows=32 cols=24
mm L0 acc[0,24] act[0,32] wgt[0,24] M=16 K=16 N=24 mode=w8 split=n accumulate=set mask=none wait=L0.dma>=2
mm L0 acc[0,24] act[16,32] wgt[384,24] M=16 K=16 N=24 mode=w8 split=n accumulate=add mask=none
dma.st L0 @y[0,24] acc[0,24,1] rows=16 cols=24 wait=L0.mat>=2
