from django.apps import AppConfig


class JobsAppConfig(AppConfig):
    name = "tests.minimal_project.jobsapp"
    label = "minimal_jobsapp"
