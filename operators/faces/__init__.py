"""The Python faces: processor.py (build_processor's Processor; lazy_job.py runs it as one lazy
read), batch_generator.py (the Generator class for Dataset.map_batches), and ray.data.llm's API
(ray_llm.py over ray_llm_config.py). They may import every other room of operators/.
"""
