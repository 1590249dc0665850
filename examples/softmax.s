; Softmax over the rows of an 8 x 32 fp32 matrix on the vector unit of Legion 0:
; y = exp(x - max(x)) / sum(exp(x - max(x))), with the row statistics broadcast by a 0 stride.
.arch dlegion-tiny
.tensor x f32[8,32] input "x"
.tensor y f32[8,32] output "y"

dma.ld L0 {0} vec[0,32,1] @x[0,32] rows=8 cols=32
vrmax L0 vec[256,1,0] vec[0,32,1] rows=8 cols=32 wait=L0.dma>=1
vsub L0 vec[0,32,1] vec[0,32,1] vec[256,1,0] rows=8 cols=32
vexp L0 vec[0,32,1] vec[0,32,1] rows=8 cols=32
vrsum L0 vec[256,1,0] vec[0,32,1] rows=8 cols=32
vdiv L0 vec[0,32,1] vec[0,32,1] vec[256,1,0] rows=8 cols=32
dma.st L0 @y[0,32] vec[0,32,1] rows=8 cols=32 wait=L0.vec>=5
